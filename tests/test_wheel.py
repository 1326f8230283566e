"""The package as users get it: the wheel builds without warnings and, installed outside the repo,
carries the plugin vLLM finds, the shipped router and the C++ sources."""
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHECK = """
import sys
from pathlib import Path
target = Path(sys.argv[1])
import sekv_vllm
assert Path(sekv_vllm.__file__).is_relative_to(target), sekv_vllm.__file__
from vllm.plugins import load_plugins_by_group
plugins = load_plugins_by_group("vllm.general_plugins")
assert Path(sys.modules[plugins["sekv"].__module__].__file__).is_relative_to(target)
from sekv_vllm.router import shipped_weights
assert "SmolLM2-135M-Instruct" in shipped_weights() and shipped_weights()["SmolLM2-135M-Instruct"].is_relative_to(target)
assert (target / "sekv_vllm/csrc/cpu/span_decode.cpp").is_file()
assert (target / "sekv_vllm/triton_kernels/span_rebuild.py").is_file()
print("ok")
"""


def test_the_wheel_installed_outside_the_repo_has_the_plugin_router_and_kernel_sources(tmp_path):
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "-w", str(tmp_path / "dist")],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    log = build.stdout + build.stderr
    # e.g. a license table (a build error after 2027-02-18), data folders not declared as packages
    assert "BuildBackendWarning" not in log and "deprecated" not in log.lower(), log[-3000:]
    wheel = next((tmp_path / "dist").glob("sekv_vllm-*.whl"))
    target = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), str(wheel)],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    # -S: no site processing, so neither the repo's editable install nor its path hooks are seen; vLLM and
    # the other dependencies come from this environment's site-packages, after the installed wheel.
    env = {"PYTHONPATH": f"{target}:{sysconfig.get_paths()['purelib']}", "PATH": "/usr/bin:/bin"}
    check = subprocess.run([sys.executable, "-S", "-c", CHECK, str(target)], capture_output=True, text=True,
                           timeout=600, cwd=tmp_path, env=env)
    assert check.returncode == 0 and check.stdout.strip().endswith("ok"), check.stderr[-3000:]
