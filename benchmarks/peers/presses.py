"""The kvpress presses the suite can run, by name (no kvpress import: the grid validates names).

Each is a prefill press whose cache really shrinks to the kept share. Left out: KVzip (2-3x
prefill passes; 45 s for one 4K prompt on 2 cores), AdaKV and other head-wise presses (they mask
entries but keep the cache full length, so they free no memory in this harness).
"""
PRESSES: dict[str, str] = {
    "snapkv": "SnapKVPress",  # attention of the last window of queries picks the kept keys
    "expected_attention": "ExpectedAttentionPress",  # kvpress's own: attention expected from future queries
    "streaming_llm": "StreamingLLMPress",  # sink tokens + recent window
    "knorm": "KnormPress",  # lowest key norm kept
    "tova": "TOVAPress",  # last query's attention, head-averaged
}
