"""The bad and odd inputs the soak sends, in rotation: raw bodies that must get a 4xx in the
OpenAI error shape, the names of those with a check of their own, and odd Authorization values.

Data only; how each answer is judged is soak_checks.py's.
"""

from __future__ import annotations

import json

from soak_cluster import API_KEY, ROUTER_MAX_BYTES

_P = '"prompt": [11, 12, 13, 14], "max_tokens": 2'
BAD_INPUTS: list[tuple[str, bytes]] = [  # each must get a 4xx in the OpenAI error shape
    ("invalid json", b'{"prompt": [1, 2'),
    ("lone surrogate", b'{"prompt": "\\ud800", "max_tokens": 2}'),
    ("10k-deep nesting", b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"),
    ("temperature 1e309", ("{" + _P + ', "temperature": 1e309}').encode()),
    ("negative max_tokens", b'{"prompt": [11, 12], "max_tokens": -1}'),
    ("client kv_transfer_params", ("{" + _P + ', "kv_transfer_params": {}}').encode()),
    ("kv_transfer_params to an instance", ("{" + _P + ', "kv_transfer_params": {}}').encode()),
    ("unknown model", ("{" + _P + ', "model": "no-such-model"}').encode()),
    ("huge body", json.dumps({"prompt": [7] * (ROUTER_MAX_BYTES // 2)}).encode()),
    # Under the routers' body limit, ~60 times the instances' max_model_len in characters.
    ("huge prompt", json.dumps({"prompt": "hello " * 40_000, "max_tokens": 2}).encode()),
    ("huge stop list", json.dumps({"prompt": [11, 12, 13, 14], "max_tokens": 2,
                                   "stop": [f"stop {i}" for i in range(10_000)]}).encode()),
]  # fmt: skip
# Odd or valid inputs, and refusals that take more than one call: each has its own check.
SPECIAL_INPUTS = ("temperature 1e-38", "top_p 1e-300", "odd Authorization",
                  "reused request id after hang-up", "replayed signed call")  # fmt: skip
ODD_AUTHORIZATIONS = [  # to router-push (which has a key): 401; to router-pull (none): served
    b"Bearer " + b"\xff\xfe" * 64,  # not UTF-8
    b"Bearer " + b"k" * 8000,  # long, still under the HTTP parser's field limit
    b"Bearer",  # a scheme and no key
    b"Basic c29hazpzb2Fr",  # another scheme
    b"Bearer " + API_KEY.encode() + b" and more",  # the key with something after it
]
