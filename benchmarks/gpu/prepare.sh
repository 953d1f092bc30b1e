#!/bin/bash
# Run HERE (where pip can reach the index), from anywhere: fills <repo>/.whl/ with the cp312
# manylinux x86-64 wheels that the lent GPU machine lacks (its python3 is 3.12 with torch, cupy,
# numpy, protobuf, tensorboard... but no pydantic & co., tensorboardX, pymetis or cuDNN's
# frontend). Idempotent: a wheel already there is kept, an other version of the same package is
# removed, so exactly one version of each travels. Prints the folder's total size at the end.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
dest=.whl
mkdir -p "$dest"
# .whl/ must be ignored by git: the device tool carries it only when named in `carry`
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || grep -qxF '.whl/' .gitignore 2>/dev/null \
  || echo '/.whl/' >> .git/info/exclude

venv_py=${FLOWCTL_VENV_PY:-$root/.venv/bin/python}
# the version installed in the project's venv, else $2
ver() {
  local v
  v=$("$venv_py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1" 2>/dev/null) || v=
  echo "${v:-$2}"
}
pydantic_v=$(ver pydantic 2.14.4)
# the pydantic-core that this pydantic pins (its Requires-Dist), whatever the venv holds
core_v=$("$venv_py" - "$pydantic_v" <<'PY' 2>/dev/null || true
import importlib.metadata as m, re, sys
if m.version("pydantic") != sys.argv[1]:
    raise SystemExit(1)
for r in m.requires("pydantic") or []:
    x = re.match(r"pydantic[-_]core\s*==\s*([\w.]+)", r)
    if x and "extra" not in r:
        print(x.group(1))
PY
)
core_v=${core_v:-$(ver pydantic-core 2.50.5)}
te_min=4.16.0   # pydantic / pydantic-core ask typing-extensions>=4.16.0; the machine's may be older

pkgs=(
  "pydantic==$pydantic_v"
  "pydantic-core==$core_v"
  "annotated-types==$(ver annotated-types 0.8.0)"
  "typing-inspection==$(ver typing-inspection 0.4.5)"
  "typing-extensions==$(ver typing-extensions $te_min)"  # run.sh installs it only if the machine's is older
  "tensorboardX==$(ver tensorboardX 2.6.5)"              # needs protobuf, numpy, packaging: all there
  "pymetis==$(ver pymetis 2025.2.2)"
  "nvidia-cudnn-frontend==1.32.0"
)
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do plat+=(--platform "$p"); done

# canonical distribution name as wheels spell it: lower case, '-' and '.' -> '_'
canon() { echo "$1" | tr 'A-Z' 'a-z' | sed 's/[-.]/_/g'; }

for spec in "${pkgs[@]}"; do
  name=${spec%%==*}; v=${spec#*==}; c=$(canon "$name")
  have=
  for f in "$dest"/*.whl; do
    [ -e "$f" ] || continue
    b=$(basename "$f"); n=$(canon "${b%%-*}"); fv=$(echo "$b" | cut -d- -f2)
    [ "$n" = "$c" ] || continue
    if [ "$fv" = "$v" ] && [ -z "$have" ]; then have=$f; else echo "removing $b (want $v)"; rm -f "$f"; fi
  done
  if [ -n "$have" ]; then echo "have $(basename "$have")"; continue; fi
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none "${plat[@]}" \
    -d "$dest" "$spec"
  echo "got  $(cd "$dest" && ls | grep -i "^$(echo "$c" | sed 's/_/[-_.]/g')-$v-" )"
done

# exactly one wheel per package
dups=$(for f in "$dest"/*.whl; do b=$(basename "$f"); canon "${b%%-*}"; done | sort | uniq -d)
[ -z "$dups" ] || { echo "more than one wheel of: $dups" >&2; exit 1; }
# nothing else in the folder but wheels
ls -la "$dest"
bytes=$(du -cb "$dest"/*.whl | tail -n1 | cut -f1)
echo "total $(ls "$dest"/*.whl | wc -l) wheels, $bytes bytes ($((bytes / 1048576)) MiB; the working tree that travels may hold 64 MiB)"
[ "$bytes" -lt $((32 * 1048576)) ] || { echo "too large" >&2; exit 1; }
