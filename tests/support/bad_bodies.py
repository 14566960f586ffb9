"""Request bodies no JSON endpoint may accept: each must be a 400, never a 500 or a crash."""

BAD_BODIES = {
    "not UTF-8": b'{"model": "tiny", "prompt": "\xff\xfe"}',
    "a lone surrogate": b'{"model": "tiny", "prompt": "\\ud800"}',
    "an encoded surrogate": b'{"model": "tiny", "prompt": "\xed\xa0\x80"}',
    "100k deep": b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "65 deep": b'{"model": "tiny", "prompt": "x", "user": ' + b"[" * 65 + b"]" * 65 + b"}",
    "NaN": b'{"model": "tiny", "prompt": "x", "temperature": NaN}',
    "1e999": b'{"model": "tiny", "prompt": "x", "temperature": 1e999}',
    "a 30-digit int": b'{"model": "tiny", "prompt": [123456789012345678901234567890]}',
    "5000 digits": b'{"model": "tiny", "prompt": [' + b"9" * 5000 + b"]}",
    "not JSON": b"model=tiny&prompt=x",
    "truncated": b'{"model": "tiny", "prompt": "x"',
}
