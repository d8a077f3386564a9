#!/usr/bin/env bash
# Lagom as a training image gets it: built into a wheel and an sdist, installed into fresh virtual
# environments that reuse the project environment's site-packages (torch, megatron-core, deepspeed), and
# run from an empty folder, where neither the checkout nor its configs/ can be found. Checks:
#   - the wheel holds every shipped data file (byte for byte) and the tuner plugin; the sdist the C sources;
#   - `lagom --version` and `python -m lagom --version`;
#   - `lagom compare` on a shipped workload and `lagom validate --json` print what the checkout prints;
#   - `lagom patch megatron --path` on a copy of the installed megatron: patch, again, revert to the bytes;
#   - a 2-rank DeepSpeed run (CPU, gloo) with a lagom section whose hardware is a user's preset found
#     through LAGOM_HARDWARE_PATH;
#   - the sdist installed with a C compiler builds the plugins; with CC=/nonexistent it installs, says
#     neither plugin nor the compiled simulator was built, and Lagom reports them unavailable.
# Usage: scripts/wheel_smoke.sh   (PYTHON=/path/to/python: the project environment, default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
py=$(realpath -s "${PYTHON:-.venv/bin/python}")
[ -x "$py" ] || { echo "wheel smoke: $py is not a Python (run 'make venv' or set PYTHON)" >&2; exit 2; }
work=$(mktemp -d "${TMPDIR:-/tmp}/lagom-smoke.XXXXXX")
trap 'rm -rf "$work"' EXIT
start=$SECONDS
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
version=$("$py" -c 'import lagom; print(lagom.__version__)')  # the checkout's: python -c puts it first on sys.path

# Without a C compiler here the wheel has no plugin, as an install without one has none: not checked then.
compiler=$("$py" -c 'from lagom.nccl_tuner.build import c_compiler; print(int(c_compiler() is not None))')
[ "$compiler" = 1 ] || echo "wheel smoke: no C compiler here: the tuner plugin's presence is not checked"

step() { printf '== %s (%ds)\n' "$*" $((SECONDS - start)); }
fail() { echo "wheel smoke: FAILED: $*" >&2; exit 1; }

# A venv whose site-packages has one path line to the project's: the project's .pth files (its editable
# install of this checkout among them) are not run there, so Lagom can only come from what is installed.
fresh_venv() {
  "$py" -m venv --without-pip "$1"
  "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' | {
    read -r own; echo "$site" > "$own/_lagom_smoke_project_site.pth"; }
}
install() {  # venv, pip arguments: the project's pip and setuptools, no index
  local venv=$1; shift
  "$py" -m pip --python "$venv/bin/python" install --no-deps --no-build-isolation --no-index "$@"
}

step "build the wheel and the sdist"
# From a copy of the files git tracks or would track: a build/ folder left by an earlier build in the
# checkout would put modules deleted since into the wheel.
mkdir "$work/src"
if git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
  git ls-files -z --cached --others --exclude-standard | tar --null -T - -c | tar -x -C "$work/src"
else
  tar --exclude=./.venv --exclude=./build --exclude='*.egg-info' --exclude=./out --exclude=./lagom/nccl_tuner/lib --exclude=./lagom/model/lib -c . \
    | tar -x -C "$work/src"
fi
(cd "$work/src" && "$py" -m pip wheel . --no-deps --no-build-isolation -q -w "$work/dist" \
  && "$py" -c "from setuptools import build_meta; build_meta.build_sdist('$work/dist')" > /dev/null)
wheel=$(ls "$work"/dist/lagom-*.whl)
sdist=$(ls "$work"/dist/lagom-*.tar.gz)
"$py" - "$wheel" "$sdist" "$compiler" <<'EOF' || fail "the wheel or the sdist lacks files (see above)"
import sys, tarfile, zipfile
from pathlib import Path
wheel, sdist = zipfile.ZipFile(sys.argv[1]), tarfile.open(sys.argv[2])
shipped = [p for folder in ("lagom/configs", "lagom_megatron/patches") for p in Path(folder).rglob("*") if p.is_file()]
bad = [str(p) for p in shipped if p.as_posix() not in wheel.namelist() or wheel.read(p.as_posix()) != p.read_bytes()]
for library, what in (("lagom/nccl_tuner/lib/libnccl-tuner-lagom.so", "the tuner plugin"),
                      ("lagom/model/lib/liblagom-event-loop.so", "the compiled simulator")):
    if sys.argv[3] == "1" and library not in wheel.namelist():
        bad.append(f"{library} ({what})")
top = sdist.getnames()[0].split("/")[0]
needed = ["setup.py", "LICENSE", "lagom/nccl_tuner/build.py", *(f"lagom/nccl_tuner/{n}" for n in ("plugin.c", "rules.c", "lagom_nccl_tuner.h", "rules.h")),
          "lagom/model/event_loop.c", "lagom/model/event_loop.h", *map(str, shipped)]
bad += [f"{n} (sdist)" for n in needed if f"{top}/{n}" not in sdist.getnames()]
for name in bad:
    print(f"missing or different: {name}")
print(f"wheel: {len(shipped)} data files and the plugin; sdist: the C sources and the data")
sys.exit(1 if bad else 0)
EOF

step "install the wheel into a fresh venv"
venv=$work/venv-wheel
fresh_venv "$venv"
install "$venv" -q "$wheel"
mkdir -p "$work/run/train" "$work/run/out" && cd "$work/run"
"$venv/bin/python" - "$venv" "$compiler" <<'EOF' || fail "the installed wheel does not work as the checkout (see above)"
import sys
import lagom, lagom_deepspeed, lagom_experiments, lagom_megatron
from lagom import nccl_tuner, resources
outside = [m.__file__ for m in (lagom, lagom_deepspeed, lagom_experiments, lagom_megatron) if not m.__file__.startswith(sys.argv[1])]
assert not outside, f"imported from outside the venv: {outside}"
assert resources.HARDWARE_DIR.is_relative_to(sys.argv[1]), resources.HARDWARE_DIR
assert sys.argv[2] == "0" or nccl_tuner.path() is not None, "the wheel's tuner plugin is not where lagom.nccl_tuner looks"
from lagom.model import compiled
assert sys.argv[2] == "0" or compiled.enabled(), "the wheel's compiled simulator is not where lagom.model.compiled looks"
from lagom.hardware import closest_preset  # what --lagom alone detects a job's machine with
assert closest_preset("NVIDIA A100-SXM4-80GB", gpus_per_node=8, nodes=1) == "a100-8x-100g"
from lagom.step.workload import workload_names
from lagom_experiments.reproduce import load_published  # what lagom reproduce compares with
assert "gpt2-tp8" in workload_names() and load_published().settings
from importlib.metadata import version
assert version("lagom") == lagom.__version__, (version("lagom"), lagom.__version__)
EOF
for cmd in "$venv/bin/lagom" "$venv/bin/python -m lagom"; do
  [ "$($cmd --version)" = "lagom $version" ] || fail "$cmd --version says '$($cmd --version)', not 'lagom $version'"
done

step "lagom compare on a shipped workload, as in the checkout"
"$venv/bin/lagom" compare phi2-fsdp --hardware a40-2x8-nvlink --json --no-tuner-plugin > compare.json
(cd "$root" && "$py" -m lagom compare configs/workloads/phi2-fsdp.yaml --hardware a40-2x8-nvlink --json --no-tuner-plugin) > compare-checkout.json
cmp compare.json compare-checkout.json || fail "lagom compare differs between the wheel and the checkout"
if "$venv/bin/lagom" compare gpt2-tp8 --hardware no-such-preset 2> unknown.txt; then fail "an unknown preset was accepted"; fi
grep -q "a100-8x-100g" unknown.txt || fail "the unknown-preset error lists no presets: $(cat unknown.txt)"

step "lagom validate --json, as in the checkout"
"$venv/bin/lagom" validate --json > validate.json
(cd "$root" && "$py" -m lagom validate --json) > validate-checkout.json
cmp validate.json validate-checkout.json || fail "lagom validate differs between the wheel and the checkout"

step "lagom patch megatron --path on a copy of the installed megatron"
mkdir -p "$work/megatron/megatron/core"
cp -r "$site/megatron/training" "$work/megatron/megatron/training"
cp "$site/megatron/core/package_info.py" "$work/megatron/megatron/core/"  # the version lagom patch reports
cp -r "$work/megatron" "$work/megatron-original"
"$venv/bin/lagom" patch megatron --path "$work/megatron" | tee patch.txt
grep -q "^patched megatron/training/arguments.py" patch.txt || fail "lagom patch megatron did not patch"
grep -q "add_lagom_arguments(parser)" "$work/megatron/megatron/training/arguments.py" || fail "the patched file lacks --lagom"
"$venv/bin/lagom" patch megatron --path "$work/megatron" | grep -q "^already patched" || fail "patching twice changed something"
"$venv/bin/lagom" patch megatron --path "$work/megatron" --revert | grep -q "^reverted" || fail "--revert did not revert"
diff -r "$work/megatron" "$work/megatron-original" > /dev/null || fail "--revert did not restore the files byte for byte"

step "a 2-rank DeepSpeed run with a lagom section and a user's preset (LAGOM_HARDWARE_PATH)"
mkdir -p "$work/presets"
cp "$root/examples/deepspeed/cpu-2ranks.yaml" "$work/presets/a100-2gpu-example.yaml"  # base: a shipped preset
cp "$root/examples/deepspeed/tiny_gpt.py" train/  # it puts train/../.. ($work, no lagom in it) on sys.path
"$py" - "$root/examples/deepspeed/ds_config_cpu.json" <<'EOF' > ds.json
import json, sys
cfg = json.load(open(sys.argv[1]))
cfg["lagom"] |= {"hardware": "a100-2gpu-example", "plan": "out/plan.json", "report": "out/report"}
print(json.dumps(cfg))
EOF
deepspeed_run() {  # python, script, folder to run in (holding ds.json): 2 CPU ranks, 6 steps, into ds.log
  local port
  port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  (cd "$3" && DS_ACCELERATOR=cpu LAGOM_HARDWARE_PATH="$work/presets" "$1" -m deepspeed.launcher.runner \
    --master_port "$port" --num_gpus 2 "$2" --deepspeed_config ds.json --steps 6 > ds.log 2>&1) \
    || { tail -40 "$3/ds.log"; fail "the DeepSpeed run in $3 failed"; }
}
deepspeed_run "$venv/bin/python" train/tiny_gpt.py "$work/run"
"$py" - <<'EOF' || { tail -40 ds.log; fail "the DeepSpeed run did not train under Lagom's plan"; }
import json
losses = [line for line in open("ds.log") if line.startswith("losses:")]
assert len(losses) == 1 and len(losses[0].split()) == 1 + 6, losses
report = json.load(open("out/report.json"))
assert len(report["steps"]) == 6 and report["hardware"] == "a100-2gpu-example", (len(report["steps"]), report["hardware"])
print(losses[0], end="")
EOF
mkdir -p "$work/run-checkout/out" && cp ds.json "$work/run-checkout/"
deepspeed_run "$py" "$root/examples/deepspeed/tiny_gpt.py" "$work/run-checkout"  # the example imports the checkout
[ "$(grep '^losses:' ds.log)" = "$(grep '^losses:' "$work/run-checkout/ds.log")" ] \
  || fail "the losses differ from the checkout's: $(grep '^losses:' "$work/run-checkout/ds.log")"

step "the sdist with a C compiler: the plugin is built"
fresh_venv "$work/venv-sdist"
install "$work/venv-sdist" -q "$sdist"
[ "$compiler" = 0 ] || "$work/venv-sdist/bin/python" -c 'from lagom import nccl_tuner; assert nccl_tuner.path() is not None' \
  || fail "the sdist installed with a C compiler has no tuner plugin"

step "the sdist with CC=/nonexistent: installs, and says the plugin is unavailable"
fresh_venv "$work/venv-nocc"
CC=/nonexistent install "$work/venv-nocc" -v "$sdist" > nocc.log 2>&1 || { tail -40 nocc.log; fail "the install without a compiler failed"; }
for library in libnccl-tuner-lagom.so libnccl-profiler-lagom.so liblagom-event-loop.so; do
  grep -q "C library $library was not built: CC=/nonexistent names no program" nocc.log \
    || fail "the install did not say $library was not built"
done
"$work/venv-nocc/bin/python" -c 'from lagom import nccl_profiler, nccl_tuner
assert nccl_tuner.path() is None and nccl_profiler.path() is None
print(nccl_tuner.UNAVAILABLE)'
"$work/venv-nocc/bin/lagom" compare gpt2-tp8 --json 2> nocc-compare.log | "$py" -c 'import json, sys; assert json.load(sys.stdin)["capability"]["tuner_plugin"] is False' \
  || fail "Lagom without the plugin plans as if it had it"
[ "$(grep -c "planning runs on the slow Python event loop" nocc-compare.log)" = 1 ] \
  || { cat nocc-compare.log; fail "Lagom without the compiled simulator did not say once that planning runs on the Python loop"; }

step "wheel smoke passed"
