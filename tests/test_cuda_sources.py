"""The CUDA sources of the built-in CUDA backends (cuda_fa2, xqa) on a CPU machine, no GPU needed.

* Both include the shared device helpers (attncore/include/attncore/ptx.cuh) and the params-layout
  export (attncore/abi.h); the JIT hash covers every header a specialization includes, so an
  edited shared header rebuilds.
* Representative specializations of every CUDA backend compile for sm_80 and sm_90 (the Hopper
  prefill for sm_90a) without register spills, but for the few known before (KNOWN_SPILLS), which
  must not grow.
* Each library exports its params structs' layout (offsetof of every field, the field names); one
  library per backend, built and linked for sm_90 here and loaded with ctypes, matches its ctypes
  mirror, and a mirror that is off by one field is refused with that field's name.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
from pathlib import Path

import pytest

from attncore.build import jit
from attncore.backends.cuda_fa2 import binding as fa2_binding
from attncore.backends.cuda_fa2 import specs as fa2_specs
from attncore.backends.xqa import binding as xqa_binding
from attncore.backends.xqa import specs as xqa_specs

needs_nvcc = pytest.mark.skipif(jit.find_nvcc() is None,
                                reason="nvcc not found (CUDA toolkit; CUDA_HOME or ATTNCORE_NVCC): CUDA sources not compiled")
# building a library (link) goes through ninja as well
needs_toolchain = pytest.mark.skipif(bool(jit.toolchain_reasons()),
                                     reason="; ".join(map(str, jit.toolchain_reasons())) or "toolchain found")

SHARED = Path(jit.INCLUDE_DIR) / "attncore"
SPECS_MODULES = {"cuda_fa2": fa2_specs, "xqa": xqa_specs}


def _all_specs():
    return (fa2_specs.list_specs("90") + [fa2_specs.selftest_spec()]
            + [k.spec() for k in fa2_specs.representative_keys()]
            + xqa_specs.list_specs("90") + [k.spec() for k in xqa_specs.representative_keys()])


def _included(spec: jit.Spec):
    """Every quoted #include a spec's sources reach, resolved as nvcc does (the including file's folder,
    then the -I dirs); raises on one that resolves nowhere."""
    seen, todo = set(), [Path(s) for s in spec.sources]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', f.read_text(), re.M):
            for d in [f.parent] + [Path(d) for d in spec.include_dirs]:
                if (d / name).is_file():
                    todo.append((d / name).resolve())
                    break
            else:
                raise AssertionError(f"{spec.uri}: {f.name} includes {name!r}, found in none of {spec.include_dirs}")
    return seen


def test_every_cuda_backend_is_covered_here():
    """A new CUDA backend (one that offers JIT specs) must be added to this file's checks."""
    from attncore.build.jit import _known_backends

    assert set(_known_backends()) <= set(SPECS_MODULES), _known_backends()


def test_shared_headers_ship_and_every_included_header_is_hashed():
    assert (SHARED / "ptx.cuh").is_file() and (SHARED / "abi.h").is_file()
    for spec in _all_specs():
        hashed = {Path(f).resolve() for f in jit._spec_files(spec)}
        used = _included(spec)
        assert (SHARED / "ptx.cuh").resolve() in used and (SHARED / "abi.h").resolve() in used, spec.uri
        assert used <= hashed, (spec.uri, sorted(map(str, used - hashed)))


def test_editing_the_shared_header_changes_the_library_hash(tmp_path):
    inc = tmp_path / "include"
    shutil.copytree(jit.INCLUDE_DIR, inc)
    for mod, key in ((fa2_specs, fa2_specs.Fa2Key()), (xqa_specs, xqa_specs.XqaKey())):
        s = key.spec()
        spec = jit.Spec(s.backend, s.uri, s.sources, s.defines, (str(mod.CSRC), str(inc)), s.extra_flags)
        before = jit.library_path(spec, "90")
        hdr = inc / "attncore" / "ptx.cuh"
        hdr.write_text(hdr.read_text() + "\n// edited\n")
        assert jit.library_path(spec, "90") != before


def _entry_reports(log: str):
    """{kernel: (stack frame, spill stores, spill loads, registers)} from a ptxas -v log."""
    out, cur = {}, None
    for ln in log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", ln)
        if m:
            cur = m.group(1)
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", ln)
        if m and cur:
            out[cur] = tuple(int(x) for x in m.groups())
        m = re.search(r"Used (\d+) registers", ln)
        if m and cur in out:
            out[cur] += (int(m.group(1)),)
            cur = None
    return out


# Spills (bytes stored, loaded) that were there before issue 14 item 4 (which changed no instruction:
# SASS identical before / after): the 128-row cuda_fa2 prefill tile at 255 registers (d128; d256 with
# fp8 KV and every feature) and the warp-specialized Hopper kernel's producer path.  A spec spilling
# more than this, or any other spec spilling at all, fails.  (A stack frame without spills is the
# local array of sincosf's slow path in the RoPE specs.)
KNOWN_SPILLS = {
    "cuda_fa2_prefill_bf16_d128_causal_sm80": (20, 20),
    "cuda_fa2_prefill_bf16_d128_causal_sm90": (52, 52),
    # (8 / 8 at sm80 and 4 / 4 at sm90 until session 37's launch groups, the CTA's item and kv head computed from
    # Fa2Params.head_group: 4 / 4 and 16 / 16 since; the groups gained 1.2-1.4x on few-wave causal prefills on the
    # FA2 kernel, BENCHMARKS.md 2ag)
    "cuda_fa2_prefill_fp16_kve4m3_d256_custom_softcap_alibi_sm80": (4, 4),
    "cuda_fa2_prefill_fp16_kve4m3_d256_custom_softcap_alibi_sm90": (16, 16),
    # (the persistent pipelined loop at d64 spilled 64 / 84 bytes from session 28 until its warpgroup index was
    # made warp-uniform, Cfg90::UWG, session 30: none since.  prefill90 d128 _pipe_ws and pod90 d128 _pipe_ws spilled
    # 4 / 4 and 8 / 8 bytes until session 42 gave their producers the lean paged copies, Cfg90::LEAN: none since)
}


@needs_nvcc
def test_representative_specs_compile_sm80_sm90_without_spills():
    specs = [k.spec() for mod in SPECS_MODULES.values() for k in mod.representative_keys()]
    res = jit.compile_check(specs, archs=("80", "90"), ptxas_verbose=True,
                            jobs=max(2, os.cpu_count() or 2))
    hopper = [fa2_specs.Fa2Key("prefill90", "bf16", "same", 128, "causal"),
              fa2_specs.Fa2Key("prefill90", "bf16", "same", 128, "causal", pipe=True),
              fa2_specs.Fa2Key("prefill90", "bf16", "same", 128, "causal", ws=True),
              fa2_specs.Fa2Key("prefill90", "bf16", "same", 128, "causal", pipe=True, ws=True),
              fa2_specs.Fa2Key("prefill90", "bf16", "same", 128, "none", pipe=True, ws=True, persist=True),
              fa2_specs.Fa2Key("prefill90", "fp16", "same", 64, "none", pipe=True, ws=True),
              fa2_specs.Fa2Key("pod90", "bf16", "same", 128, "causal", pipe=True, ws=True),
              fa2_specs.Fa2Key("pod90", "fp16", "same", 64, "none", ws=True),
              fa2_specs.Fa2Key("pod90", "bf16", "same", 64, "causal", pipe=True, ws=True),
              fa2_specs.Fa2Key("prefill90", "bf16", "same", 192, "causal", pipe=True, ws=True, head_dim_vo=128),
              fa2_specs.Fa2Key("prefill90", "fp16", "same", 192, "none", ws=True, head_dim_vo=128)]  # (paged K/V)
    res += jit.compile_check([k.spec() for k in hopper], archs=("90",), ptxas_verbose=True, jobs=2)
    assert len(res) == 2 * len(specs) + len(hopper)
    for r in res:
        uri = r.spec.uri_for(r.arch)
        reports = _entry_reports(r.log)
        assert reports, (uri, r.log)
        known = KNOWN_SPILLS.get(uri, (0, 0))
        for kernel, (stack, stores, loads, *regs) in reports.items():
            assert stores <= known[0] and loads <= known[1], (uri, kernel, stores, loads, r.log)
            assert regs and regs[0] <= 255, (uri, kernel)


def test_every_spec_of_a_backend_builds_from_its_one_source():
    """The layout exports live in each backend's one .cu, so every library has them."""
    for mod in SPECS_MODULES.values():
        keys = mod.representative_keys() + (mod.common_keys() if hasattr(mod, "common_keys") else mod.default_keys())
        assert {k.spec().sources for k in keys} == {(mod.SOURCE,)}
        assert "AC_EXPORT_LAYOUT(" in Path(mod.SOURCE).read_text()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One library per backend, built and linked for sm_90 (no GPU needed) into a private cache."""
    cache = tmp_path_factory.mktemp("jit-cache")
    libs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATTNCORE_CACHE_DIR", str(cache))
        mp.setenv("ATTNCORE_JIT_QUIET", "1")
        for name, spec in (("cuda_fa2", fa2_specs.Fa2Key("decode", "fp16", "same", 64, "none").spec()),
                           ("xqa", xqa_specs.XqaKey("fp16", "same", "same", 64, 1).spec())):
            libs[name] = ctypes.CDLL(str(jit.build_spec(spec, "90").path))
    return libs


def _c_layout(cdll, prefix):
    fn = getattr(cdll, prefix + "_offsets")
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    names = getattr(cdll, prefix + "_fields")
    names.restype = ctypes.c_char_p
    buf = (ctypes.c_int * 256)()
    n = fn(buf, 256)
    return list(zip(names().decode().split(), buf[:n]))


@needs_toolchain
@pytest.mark.parametrize("backend,prefix,struct", [
    ("cuda_fa2", "fa2_params", fa2_binding.Fa2Params),
    ("cuda_fa2", "fa2_merge_params", fa2_binding.Fa2MergeParams),
    ("xqa", "xqa_params", xqa_binding.XqaParams),
])
def test_layout_export_matches_the_ctypes_mirror(built, backend, prefix, struct):
    lib = built[backend]
    layout = _c_layout(lib, prefix)
    assert layout == [(f[0], getattr(struct, f[0]).offset) for f in struct._fields_]
    size = getattr(lib, prefix + "_size")
    size.restype = ctypes.c_int
    assert size() == ctypes.sizeof(struct)
    # the checks the bindings run at load
    if backend == "cuda_fa2":
        fa2_binding.check_params_layout(lib)
    else:
        xqa_binding.check_layout(lib)


def _mirror(struct, edit):
    return type("Bad" + struct.__name__, (ctypes.Structure,), {"_fields_": edit(list(struct._fields_))})


@needs_toolchain
@pytest.mark.parametrize("edit,field", [
    (lambda f: [(n, ctypes.c_int64 if n == "num_qo_heads" else t) for n, t in f], "num_kv_heads"),  # retyped: the next moves
    (lambda f: [x for x in f if x[0] != "one_kv_base"], "scale_log2"),  # dropped: the next one is off
    (lambda f: [x if x[0] != "group" else ("grp", x[1]) for x in f], "grp"),  # renamed, same offset
    (lambda f: f[:-1], "kv_rows"),  # C has one more
])
def test_a_wrong_mirror_is_refused_naming_the_field(built, edit, field):
    with pytest.raises(RuntimeError, match=f"field '{field}'"):
        fa2_binding.check_layout(built["cuda_fa2"], "fa2_params", _mirror(fa2_binding.Fa2Params, edit), "cuda_fa2")


@needs_toolchain
def test_a_wrong_xqa_mirror_is_refused_naming_the_field(built):
    bad = _mirror(xqa_binding.XqaParams, lambda f: [(n, ctypes.c_int64 if n == "mask_words16" else t) for n, t in f])
    with pytest.raises(RuntimeError, match="field 'mask_words16'"):
        xqa_binding.check_layout(built["xqa"], struct=bad)
    swapped = _mirror(xqa_binding.XqaParams, lambda f: [
        {"k": ("v", t), "v": ("k", t)}.get(n, (n, t)) for n, t in f])
    with pytest.raises(RuntimeError, match="field 'v'"):
        xqa_binding.check_layout(built["xqa"], struct=swapped)
