"""The one-row GEMVs' sm_90 builds in each K-loop form (kernels_src/gemv_loop.py), on a CPU: the main loop's
instructions, global loads (LDG) and cp.async (LDGSTS), registers, shared memory, spills, and the 1-warp programs an
SM can then hold. `python -m tools.gemv_loop_builds [--forms plain,prefetch,stages2,stages3]`."""

from __future__ import annotations

import argparse

FORMS = {"plain": {}, "prefetch": dict(PREFETCH=True), "stages2": dict(STAGES=2), "stages3": dict(STAGES=3)}
SM_REGS, SM_SHARED, SM_BLOCKS = 65536, 228 * 1024, 32  # sm_90: registers, shared bytes and programs an SM


def programs_an_sm(regs: int, shared: int, warps: int) -> int:
    """Programs of `warps` warps an SM holds at those registers (allocated per warp in 256s) and shared bytes (with
    the 1 KiB the system keeps per program)."""
    by_regs = SM_REGS // (warps * -(-regs * 32 // 256) * 256)
    by_shared = SM_SHARED // (shared + 1024) if shared else SM_BLOCKS
    return min(SM_BLOCKS, by_regs, by_shared)


def cases() -> list[tuple[str, object, dict, int, dict]]:
    """(name, kernel, signature's pointers, num_warps, constexprs) at the tiles decode steps take."""
    from kernels_src import dequant_gemv as dg
    from kernels_src import dequant_gemv_i8 as dgi
    from kernels_src import fp8_gemv as fg
    from kernels_src import int_group_gemv as ig
    from kernels_src import int_group_gemv_i8 as igi

    i8 = dict(w="*u8", xq="*i8", xd="*fp32", y="*bf16")
    out = []
    for q, n, k, words in (("Q4_K", 14336, 4096, False), ("Q5_K", 14336, 4096, False), ("Q6_K", 14336, 4096, False),
                           ("Q6_K", 14336, 4096, True), ("Q6_K", 128256, 4096, True)):
        t = dg.default_tiles(q, 1, n, k)
        out.append((f"{q} int8 {n}x{k}{' words' if words else ''} rows {t['ROWS']} step {t['STEP']}",
                    dgi.dequant_gemv_i8_kernel, i8, t["num_warps"],
                    dict(QTYPE=q, M=1, ROWS=t["ROWS"], STEP=t["STEP"], PDL=True, WORDS=words)))
    for n in (28672, 4096):
        t = ig.default_tiles(1, n)
        out.append((f"int4 g128 int8 N {n} rows {t['ROWS']} lanes {t['LANES']}", igi.int_group_gemv_i8_kernel,
                    dict(w="*i32", xq="*i8", xd="*fp32", xs="*fp32", xr="*fp32", y="*bf16"), t["num_warps"],
                    dict(BITS=4, GROUP=128, M=1, ROWS=t["ROWS"], LANES=t["LANES"], VEC=4, PDL=True)))
    t = fg.default_tiles(4096, 1)
    out.append((f"fp8 g128 rows {t['ROWS']} block_k {t['BLOCK_K']}", fg.fp8_gemv_kernel,
                dict(codes="*u8", scales="*fp32", x="*bf16", y="*bf16"), t["num_warps"],
                dict(GROUP=128, M=1, ROWS=t["ROWS"], BLOCK_K=t["BLOCK_K"], EVEN_K=True, PDL=True)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.gemv_loop_builds", description=__doc__.splitlines()[0])
    ap.add_argument("--forms", default=",".join(FORMS), help=f"of {', '.join(FORMS)}")
    forms = [f.strip() for f in ap.parse_args(argv).forms.split(",") if f.strip()]
    if not forms or any(f not in FORMS for f in forms):
        ap.error(f"--forms: of {', '.join(FORMS)}")
    from kernels_src.dsl import launch
    from kernels_src.dsl.triton_target import aot_compile
    from tools.sass_mix import loop_mix

    print(f"{'kernel':44} {'form':9} {'loop':>5} {'LDG':>4} {'LDGSTS':>6} {'regs':>4} {'shared':>6} {'stack':>5} "
          f"{'programs/SM':>11}")
    for name, fn, ptrs, warps, consts in cases():
        for form in forms:
            if "QTYPE" in consts and consts["ROWS"] >= 8 and FORMS[form].get("STAGES", 0) >= 3:
                print(f"{name:44} {form:9} (not built: Triton's compile of it takes 40 s for Q4_K, over 15 min for "
                      "Q6_K words)", flush=True)
                continue
            kern = launch.compile(fn, "triton", **consts, **FORMS[form])
            kir = kern.trace(signature=ptrs | {p: "i32" for p in kern.runtime_params if p not in ptrs})
            ck = aot_compile(kir, arch=90, num_warps=warps, num_stages=3, aligned=True)
            mix = loop_mix(ck.asm["cubin"])
            shared = ck.metadata.shared
            print(f"{name:44} {form:9} {mix.instructions:5} {mix.opcodes['LDG']:4} {mix.opcodes['LDGSTS']:6} "
                  f"{mix.registers:4} {shared:6} {mix.stack:5} {programs_an_sm(mix.registers, shared, warps):11}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
