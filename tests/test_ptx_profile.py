"""The static PTX profile's parsers and hazard checks (`ptx_profile`, the
ptxas report of `aot_compile`, the register split of `kernels.sm90.hardware`) on
small hand-written PTX: no compile, no CUDA packages. The compiled kernels'
profiles are checked in tests/test_sm90_aot.py."""

from __future__ import annotations

import pytest

from pallas_fa3.tools.aot import compiler as aot_compile, ptx_profile


def test_ptxas_report_parser():
  text = (
    "ptxas warning : Registers are spilled to local memory in function"
    " 'k', 24 bytes spill stores, 16 bytes spill loads\n"
    "ptxas info    : Function properties for k\n"
    "    0 bytes stack frame, 24 bytes spill stores, 16 bytes spill loads\n"
    "ptxas info    : Used 168 registers, used 16 barriers\n"
  )
  assert aot_compile.parse_ptxas(text) == (168, 24, 16)
  with pytest.raises(RuntimeError, match="no ptxas report"):
    aot_compile.parse_ptxas("nothing here")


# A consumer loop in the shape Mosaic writes it: inline-assembly wgmma and
# mbarrier spin loops (local labels), a wait, the softmax, a backward branch.
_PTX = """
.visible .entry fa3_fwd_mosaic_gpu_kernel(
.maxntid 384, 1, 1
{
\tmov.b32 \t%r1, 256;
\t@%p3 mbarrier.init.shared.b64 [%r9], %r1;
\tmov.b32 \t%r2, 1;
\tmbarrier.init.shared.b64 [%r8], %r2;
\tsetmaxnreg.inc.sync.aligned.u32 240;
\tsetmaxnreg.dec.sync.aligned.u32 24;
\tcp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%r3], [%rd1, {%r4} ], [%r5];
$L__BB0_5:
\t// begin inline asm
\t{ .reg .pred p; setp.ne.b32 p, 1, 0; wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%r10}, %rd2, %rd3, p, 1, 1, 0, 0; }
\t// end inline asm
\t{ .reg .pred P1; LAB_WAIT: mbarrier.try_wait.parity.shared.b64 P1, [%r6], %r7; @P1 bra.uni DONE; bra.uni LAB_WAIT; DONE: }
\tld.global.f32 \t%f9, [%rd6];
\twgmma.commit_group.sync.aligned;
\twgmma.wait_group.sync.aligned 1;
\tld.global.f32 \t%f8, [%rd6];
\tfma.rn.f32 \t%f1, %f2, %f3, %f4;
\tex2.approx.ftz.f32 \t%f5, %f1;
\tmul.f32 \t%f6, %f5, %f7;
\tshfl.sync.bfly.b32 \t%r11, %r12, 1, 31, -1;
\tbar.sync \t1, 256;
\tmbarrier.arrive.release.cta.shared::cta.b64 %rd4, [%r6];
\t@%p1 bra \t$L__BB0_5;
\twgmma.wait_group.sync.aligned 0;
\tcp.async.bulk.tensor.5d.global.shared::cta.bulk_group [%rd5, {%r4}], [%r3];
\tcp.reduce.async.bulk.tensor.5d.global.shared::cta.add.f32.bulk_group [%rd5, {%r4}], [%r3];
\tret;
}
"""


def test_ptx_profile_reads_the_loop_and_the_sync():
  p = ptx_profile.profile_ptx(
    "k",
    _PTX,
    registers=168,
    spill_store_bytes=0,
    spill_load_bytes=0,
    smem_bytes=2048,
  )
  assert p.threads == 384
  assert p.setmaxnreg == ("inc 240", "dec 24")
  assert p.wgmma == {"m64n128k16 f32.bf16.bf16": 1}
  assert p.wait_group == {0: 1, 1: 1}
  assert (
    p.mbarrier_arrival_counts == (1, 256) and p.max_mbarrier_arrivals == 256
  )
  assert p.named_barrier_ops == {"bar.sync": 1}
  assert p.tma == {"load": 1, "store": 1, "reduce": 1}
  assert p.loop == {
    "wgmma": 1,
    "wait_group": 1,
    "ex2": 1,
    "ffma": 1,
    "fmul": 1,
    "shfl": 1,
    "mbarrier": 2,
    "bar": 1,
    "ldg": 2,
    "ldg_exposed": 1,  # the one between the wait and the exp2
    "total": p.loop["total"],
  }
  # The loop: setp, wgmma, try_wait and its two branches, two loads,
  # commit, wait, fma, ex2, mul, shfl, bar, arrive, the back branch.
  assert p.loop["total"] == 16
  row = ptx_profile.table([p]).splitlines()[2]
  assert row.startswith(
    "| k | 384 | 168 | inc 240 dec 24 | 504/504 | 0/0 | 2.0 | 1x m64n128k16"
  )


def _split_profile(threads, registers, *sites):
  ptx = f".maxntid {threads}, 1, 1\n" + "".join(
    f"setmaxnreg.{site.split()[0]}.sync.aligned.u32 {site.split()[1]};\n"
    for site in sites
  )
  return ptx_profile.profile_ptx(
    "k",
    ptx,
    registers=registers,
    spill_store_bytes=0,
    spill_load_bytes=0,
    smem_bytes=None,
  )


@pytest.mark.parametrize(
  "threads,registers,sites,need,problem",
  [
    (384, 168, ("inc 240", "dec 24"), 504, None),  # FA3's split: the pool
    (384, 168, ("inc 232", "dec 40"), 504, None),
    (384, 168, ("inc 240", "dec 32"), 512, "never completes"),  # the bug
    (256, 255, ("inc 256", "dec 64"), 320, None),  # one consumer
    (384, 168, ("inc 244", "dec 24"), 520, "multiple of 8"),
    (384, 168, ("inc 240",), 720, "never completes"),  # no producer decrease
    (384, 168, (), 504, None),  # no split: nothing to check
  ],
)
def test_register_pool_check(threads, registers, sites, need, problem):
  """(warpgroups - producers) x consumer + producers x producer must fit
  in warpgroups x ptxas's launch count; values multiples of 8 in
  [24, 256]."""
  p = _split_profile(threads, registers, *sites)
  problems = ptx_profile.register_problems(p)
  assert ptx_profile.register_budget(p)[0] == need
  if problem is None:
    assert problems == []
  else:
    assert any(problem in m for m in problems), problems
    assert "OVER" in ptx_profile.table([p])


def test_named_barrier_check():
  ptx = (
    ".maxntid 384, 1, 1\n"
    "bar.sync 8, 256;\nbar.arrive 8, 256;\nbarrier.sync 0;\n"
    "bar.sync 9, 100;\nbar.arrive 10, 256;\nbar.sync 10, 128;\n"
    "bar.sync 17, 128;\n"
  )
  p = ptx_profile.profile_ptx(
    "k",
    ptx,
    registers=168,
    spill_store_bytes=0,
    spill_load_bytes=0,
    smem_bytes=None,
  )
  assert p.named_barriers == (
    (0, 384),
    (8, 256),
    (9, 100),
    (10, 128),
    (10, 256),
    (17, 128),
  )
  problems = ptx_profile.named_barrier_problems(p)
  assert len(problems) == 3, problems
  assert any("barrier 9 counts 100" in m for m in problems)
  assert any("barrier 17: ids are 0-15" in m for m in problems)
  assert any(
    "barrier 10 is used with thread counts [128, 256]" in m for m in problems
  )


def test_kernel_splits_fit_the_pool_and_a_bad_one_is_refused():
  from pallas_fa3.kernels.sm90 import common, hardware

  assert (
    hardware.launch_registers(3) == 168 and hardware.register_pool(3) == 504
  )
  assert not hardware.split_problems(
    3, common.CONSUMER_REGS, common.PRODUCER_REGS
  )
  with pytest.raises(ValueError, match="never completes"):
    hardware.check_split(3, 240, 32)


def test_ptx_profile_without_a_loop():
  p = ptx_profile.profile_ptx(
    "k",
    "ret;",
    registers=1,
    spill_store_bytes=0,
    spill_load_bytes=0,
    smem_bytes=None,
  )
  assert p.loop["total"] == 0 and p.wgmma == {} and p.threads == 0


@pytest.mark.parametrize(
  "note",
  [
    "ptxas info    : (C7508) Potential Performance Loss: 'setmaxnreg'"
    " ignored; unable to determine register count at entry.",
    "ptxas info    : (C7504) Potential Performance Loss: 'setmaxnreg'"
    " ignored to maintain compatibility across compilation units.",
  ],
)
def test_a_setmaxnreg_that_ptxas_ignored_fails_the_compile(tmp_path, note):
  """The PTX asks for FA3's split, which the pool check passes; ptxas's note
  that it kept the launch count instead is a budget problem (`aot` fails
  on it) and shows in the table."""
  report = (
    f"{note}\nptxas info    : Function properties for fa3_fwd\n"
    "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
    "ptxas info    : Used 168 registers, used 16 barriers\n"
  )
  (tmp_path / "fa3_fwd_0.ptxas").write_text(report)
  (tmp_path / "fa3_fwd_0.ptx").write_text(
    ".maxntid 384, 1, 1\nsetmaxnreg.inc.sync.aligned.u32 240;\n"
    "setmaxnreg.dec.sync.aligned.u32 24;\n"
  )
  (kernel,) = aot_compile.kernel_profiles(tmp_path, "d128")
  assert kernel.setmaxnreg == ("inc 240", "dec 24")
  assert kernel.setmaxnreg_ignored == (note.strip(),)
  problems = aot_compile.budget_problems(
    aot_compile.CompileReport("d128", 168, 0, 0, (kernel,))
  )
  assert problems == [f"fa3_fwd d128: ptxas ignored its setmaxnreg: {note}"]
  assert "inc 240 dec 24 (ignored by ptxas) | 504/504 OVER" in (
    ptx_profile.table([kernel])
  )
  # Without the note the same kernel has no problem.
  (tmp_path / "fa3_fwd_0.ptxas").write_text(report.split("\n", 1)[1])
  (kernel,) = aot_compile.kernel_profiles(tmp_path, "d128")
  assert ptx_profile.register_problems(kernel) == []


# A consumer loop as ptxas writes it (Mosaic's `.sass_ctrl`): the S GEMM,
# the P.V GEMM, a partial wait, then the softmax's exp2. `hoisted` waits for
# every group first, as ptxas does when it cannot keep P.V in flight.
_SASS = """
.L_x_3:
   -:-:-:Y:01        /*4a00*/                   HGMMA.64x192x16.F32.BF16 R24, gdesc[UR16], RZ, !UPT, gsb0 ;
   -:-:-:Y:01        /*4b80*/                   HGMMA.64x64x16.F32.BF16 R120, R152, gdesc[UR8].tnspB, R120, gsb0 ;
   -:-:-:-:02        /*4d40*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
{hoisted}   -:-:-:Y:01        /*5780*/                   MUFU.EX2 R31, R52 ;
   -:-:-:Y:01        /*5790*/                   MUFU.EX2 R32, R53 ;
   -:-:-:-:02        /*5800*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
   -:-:-:Y:05        /*5810*/              @!P1 BRA `(.L_x_3) ;
   -:-:-:Y:05        /*5820*/                   EXIT ;
"""
_FULL_WAIT = "   -:-:-:-:02        /*5110*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;\n"


@pytest.mark.parametrize("hoisted", [False, True])
def test_sass_exp2_under_an_in_flight_wgmma(hoisted):
  sass = _SASS.replace("{hoisted}", _FULL_WAIT if hoisted else "")
  assert ptx_profile.sass_ex2_in_flight(sass) == ((0, 2) if hoisted else (2, 2))
  p = ptx_profile.profile_ptx(
    "k",
    _PTX,
    registers=168,
    spill_store_bytes=0,
    spill_load_bytes=0,
    smem_bytes=2048,
    sass=sass,
  )
  # The PTX loop: its exp2 follows a partial wait (wait_group 1).
  assert p.ex2_in_flight == (1, 1)
  assert p.sass_ex2_in_flight == ((0, 2) if hoisted else (2, 2))
  row = ptx_profile.table([p]).splitlines()[2]
  assert (" 1/1 0/2 |" if hoisted else " 1/1 2/2 |") in row


def test_in_flight_reads_the_loop_cyclically():
  # Rotated: the exp2 comes first in the body, under the previous step's
  # P.V (issued at the end of the body, retired by the wait that follows).
  events = ["ex2", "wait0", "mma", "wait", "ex2", "mma"]
  assert ptx_profile.ex2_under_wgmma(events) == (2, 2)
  assert ptx_profile.ex2_under_wgmma(["ex2", "ex2"]) == (0, 2)
  assert ptx_profile.ex2_under_wgmma(["mma", "ex2", "wait"]) == (1, 1)


_PRODUCER = """
\tmov.b32 \t%r1, 128;
\tmbarrier.arrive.expect_tx.shared.b64 %rd9, [%rd1], %r1;
$L__BB1_2:
\tmov.b32 \t%r2, 256;
\tmbarrier.arrive.expect_tx.shared.b64 %rd2, [%rd3+16], %r2;
\t@%p1 cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%r4], [%rd5, {%r6} ], [%r7];
\tmbarrier.arrive.expect_tx.shared.b64 %rd4, [%rd3+32], %r2;
\t@%p2 mbarrier.arrive.expect_tx.shared.b64 %rd6, [%rd3+32], 512;
\t@%p1 bra \t$L__BB1_2;
\tret;
"""


def test_tma_bytes_per_producer_step():
  # Uniform arrivals carry 1/128 of a copy's bytes per lane (256 -> 32 KiB),
  # a predicated one all of them; the load before the loop (a Q tile) is
  # not a step's.
  assert ptx_profile.tma_loop_bytes(_PRODUCER) == (66048, (32768, 33280))
  p = ptx_profile.profile_ptx(
    "k",
    _PRODUCER,
    registers=1,
    spill_store_bytes=0,
    spill_load_bytes=0,
    smem_bytes=None,
  )
  assert "| 66048 (32768+33280) |" in ptx_profile.table([p])
  assert ptx_profile.tma_loop_bytes("ret;") is None
  # An operand the profile cannot resolve gives no figure, not a wrong one.
  unknown = _PRODUCER.replace("mov.b32 \t%r2, 256;", "add.s32 %r2, %r8, 1;")
  assert ptx_profile.tma_loop_bytes(unknown) is None
