"""The tree's layers: method code (core, methods), router, policies, runtime and training import without vLLM."""
import subprocess
import sys

CHECK = """
import sys
class NoVLLM:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("vllm is blocked in this test")
sys.meta_path.insert(0, NoVLLM())
import sekv_vllm.core, sekv_vllm.methods, sekv_vllm.router, sekv_vllm.policies, sekv_vllm.pool, sekv_vllm.runtime, sekv_vllm.config
import sekv_vllm.training.train, sekv_vllm.tasks.ruler
assert not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules)
print("ok")
"""


def test_core_router_policies_runtime_training_import_without_vllm():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
