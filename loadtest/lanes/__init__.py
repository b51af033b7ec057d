"""The `lanes` scenario (issue 10): short prompts kept out of long prefills.

- `bench`: the sittings, `python -m loadtest lanes`: every setup on the same requests, per load;
- `targets`: issue 10's targets, judged in a sitting or on a saved report
  (`python -m loadtest.lanes.targets`);
- `pool`: the targets over many sittings (`python -m loadtest.lanes.pool`);
- `ideal`: the long prompts' TTFT on an ideal fleet (`python -m loadtest.lanes.ideal`).

`targets` imports none of the others and each of them imports it; `ideal` also builds
`bench`'s requests.
"""
