"""One request, from its key to its answer: the handler every proxied route runs.

`handler` (`Proxy`: place, attempt, retry, answer), `attempt` (one attempt as values),
`intake` (key, body, model, lane), `auth` (the keys, compared in constant time), `tenants`
(whose key: its name, models and limits), `limiter` (applying a key's limits, the
headers that say where it stands), `body`, `form` and `jsoncodec`
(reading the request), `tokens`, `imagesize` and `tokenizer` (the prompt estimate),
`anthropic_body` (a Messages body read as the chat request vLLM makes of it), `migration`
(a stream its instance broke continued on another), `disaggregate` (the prefill hop).
May import: every package below it: the vocabulary, `dispatch`, `config`, `upstream`,
`observe`, `fleet`, `relay`.
"""
