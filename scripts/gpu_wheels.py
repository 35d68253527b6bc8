"""The wheels a bare GPU image lacks for titanctl, pinned, for CPython 3.12 on x86-64 Linux, into .whl/.

    python scripts/gpu_wheels.py [--dest .whl] [--check-only] [--resolve [--python PYTHON3.12]]

scripts/gpu_check.sh's install step installs them there with ``pip install --no-index --no-deps --target``
(never a second torch: none of them is torch or a package the image holds). Three checks, the first two
after every download:

- each wheel is the pinned version, one per name, with tags CPython 3.12 on manylinux x86-64 accepts;
- the set is complete: every requirement of titanctl (pyproject.toml, no extras, markers evaluated for
  CPython 3.12 on Linux) and, again and again, of each wheel here is met by a wheel here or by a package
  of the image (IMAGE: its package list as read on a machine of that image, with the versions read
  there where known, each such version checked against the requirement);
- ``--resolve`` (needs the package index): pip's own resolver for CPython 3.12 over titanctl's
  requirements, with the image's known versions as constraints, lists every distribution the
  requirements reach; those the image lacks must be exactly the wheels here.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
# The versions constraints.txt pins (what the suite runs with), of the packages the image lacks.
WHEELS = {"torchao": "0.18.0", "datasets": "5.2.0", "dill": "0.4.1", "multiprocess": "0.70.19"}
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 24, 17)] + ["manylinux2014_x86_64",
                                                                                   "manylinux1_x86_64"]
PYTHON = (3, 12)
MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
# The GPU image's packages (the device tool's KINDS.md, "Python packages already there", read 2026-11-17)
# and the versions its pip list showed (2026-11); None: present, version not read.
_IMAGE_NAMES = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning
pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz
torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
"""
_IMAGE_VERSIONS = {"accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0",
                   "sentencepiece": "0.2.2", "tiktoken": "0.14.0", "tokenizers": "0.23.2", "torch": "2.11.0",
                   "transformers": "5.17.0", "triton": "3.6.0", "torchaudio": "2.11.0", "torchvision": "0.26.0"}
IMAGE = {canonicalize_name(n): _IMAGE_VERSIONS.get(n) for n in _IMAGE_NAMES.split()}


def download(dest: Path) -> None:
    dest.mkdir(exist_ok=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    for name, version in WHEELS.items():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                        "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", *platforms,
                        "-d", str(dest), f"{name}=={version}"], check=True)


def _accepted_tags() -> set[Tag]:
    return {*cpython_tags(PYTHON, platforms=PLATFORMS), *compatible_tags(PYTHON, "cp312", platforms=PLATFORMS)}


def _requires(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        metadata = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        lines = z.read(metadata).decode().splitlines()
    return [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]


def _applies(req: Requirement) -> bool:
    return req.marker is None or req.marker.evaluate(MARKERS)


def check(dest: Path) -> list[str]:
    """Problems with the wheels in ``dest`` (none: the set is right and complete)."""
    problems, wheels = [], {}
    accepted = _accepted_tags()
    for path in sorted(dest.glob("*.whl")):
        name, version, _, tags = parse_wheel_filename(path.name)
        if name in wheels:
            problems.append(f"two wheels of {name}: {wheels[name][0].name} and {path.name} (keep one)")
        wheels[name] = (path, str(version))
        if WHEELS.get(name) != str(version):
            problems.append(f"{path.name}: not a pinned wheel ({', '.join(f'{k}=={v}' for k, v in WHEELS.items())})")
        if not tags & accepted:
            problems.append(f"{path.name}: its tags do not fit CPython 3.12 on manylinux x86-64")
        if name in IMAGE:
            problems.append(f"{path.name}: the image has {name}; installing it beside would shadow the image's")
    problems += [f"no wheel of {n}=={v} in {dest}" for n, v in WHEELS.items() if canonicalize_name(n) not in wheels]
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    todo = [("titanctl", Requirement(line)) for line in pyproject["project"]["dependencies"]]
    seen = set()
    while todo:
        who, req = todo.pop()
        name = canonicalize_name(req.name)
        if not _applies(req) or (name, str(req.specifier)) in seen:
            continue
        seen.add((name, str(req.specifier)))
        if name in wheels:
            path, version = wheels[name]
            if not req.specifier.contains(version, prereleases=True):
                problems.append(f"{who} asks {req}, the wheel is {version}")
            todo += [(name, r) for r in _requires(path)]
        elif name in IMAGE:
            version = IMAGE[name]
            if version is not None and not req.specifier.contains(version, prereleases=True):
                problems.append(f"{who} asks {req}, the image has {version}")
        else:
            problems.append(f"{who} needs {req}: neither the image nor {dest.name}/ has it")
    return problems


def resolve(dest: Path, python: str) -> list[str]:
    """pip's resolver in ``python`` (a CPython 3.12) over titanctl's requirements, the image's known versions
    pinned: the distributions it would install that the image lacks, against the wheels in ``dest``."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    version = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True,
                             text=True, check=True).stdout.split()
    if tuple(map(int, version)) != PYTHON:
        raise SystemExit(f"--resolve needs a CPython 3.12 (the image's): {python} is {'.'.join(version)}; "
                         "give one with --python")
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "image.txt"
        constraints.write_text("".join(f"{n}=={v}\n" for n, v in IMAGE.items() if v))
        report = Path(tmp) / "report.json"
        subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--dry-run",
                        "--ignore-installed", "--only-binary=:all:", "--target", str(Path(tmp) / "target"),
                        "--report", str(report), "-c", str(constraints), *pyproject["project"]["dependencies"]],
                       check=True)
        resolved = {canonicalize_name(item["metadata"]["name"]): item["metadata"]
                    for item in json.loads(report.read_text())["install"]}
    # What titanctl's requirements reach without going through a package the image already holds (its
    # own requirements are met there: the image runs them).
    missing, todo = {}, [Requirement(line) for line in pyproject["project"]["dependencies"]]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if not _applies(req) or name in IMAGE or name in missing:
            continue
        missing[name] = resolved[name]["version"]
        todo += [Requirement(r) for r in resolved[name].get("requires_dist", [])]
    wheels = {parse_wheel_filename(p.name)[0]: str(parse_wheel_filename(p.name)[1]) for p in dest.glob("*.whl")}
    print(f"pip resolves titanctl's requirements for CPython 3.12 to {len(resolved)} distributions; they reach "
          "these that the image lacks: "
          f"{', '.join(f'{n}=={v}' for n, v in sorted(missing.items()))}")
    problems = [f"the resolver needs {n} (it picked {v}), which {dest.name}/ lacks" for n, v in missing.items()
                if n not in wheels]
    problems += [f"{dest.name}/ has {n}, which the resolver does not need" for n in wheels if n not in missing]
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=REPO / ".whl")
    parser.add_argument("--check-only", action="store_true", help="check the wheels already there, download none")
    parser.add_argument("--resolve", action="store_true", help="also ask pip's resolver (needs the package index)")
    parser.add_argument("--python", default=sys.executable, help="the CPython 3.12 whose pip --resolve asks")
    opts = parser.parse_args()
    if not opts.check_only:
        download(opts.dest)
    problems = check(opts.dest) + (resolve(opts.dest, opts.python) if opts.resolve else [])
    for problem in problems:
        print(f"problem: {problem}")
    size = sum(p.stat().st_size for p in opts.dest.glob("*.whl")) / 2**20
    print(f"{len(list(opts.dest.glob('*.whl')))} wheels, {size:.1f} MiB in {opts.dest}: "
          + ("complete for the GPU image" if not problems else f"{len(problems)} problem(s)"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
