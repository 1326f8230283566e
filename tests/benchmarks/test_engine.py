"""The benchmarks' engine helper: the context asked for is capped at the model's own."""
import json

from benchmarks.engine import model_context


def test_model_context_reads_the_models_limit(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192, "hidden_size": 576}))
    assert model_context(str(tmp_path)) == 8192
