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


def test_vllm_internals_are_imported_only_in_the_version_folder():
    # The adapter's version-neutral modules reach vLLM only through integration/vllm/version.py; the
    # logits-processor entry point (request_params.py) is vLLM's plugin interface.
    import ast
    from pathlib import Path

    import sekv_vllm.integration.vllm as adapter

    root = Path(adapter.__file__).parent
    allowed = {"version.py", "request_params.py"}
    offenders = []
    for path in root.glob("*.py"):
        if path.name in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {n}" for n in names if n == "vllm" or n.startswith("vllm.")]
    assert not offenders, offenders
    assert (root / "v0_32" / "shims.py").exists() and (root / "v0_32" / "runner_view.py").exists()


def test_another_vllm_version_is_refused_naming_both():
    import pytest

    from sekv_vllm.integration.vllm.version import check_version

    check_version("0.32.0")
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.x .* vLLM 0\.33\.1 is installed"):
        check_version("0.33.1")


def test_method_code_makes_every_tensor_on_its_inputs_device():
    # core/, methods/ and policies/ run on the device of the tensors they are given (CPU here, a GPU later):
    # a factory call without `device=` would put a tensor on the CPU beside GPU inputs.
    import ast
    from pathlib import Path

    import sekv_vllm

    factories = {"zeros", "ones", "arange", "tensor", "empty", "full", "eye"}
    root = Path(sekv_vllm.__file__).parent
    offenders = []
    for folder in ("core", "methods", "policies"):
        for path in (root / folder).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in factories
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                        and not any(k.arg == "device" for k in node.keywords)):
                    offenders.append(f"{folder}/{path.name}:{node.lineno} torch.{node.func.attr}")
    assert not offenders, offenders
