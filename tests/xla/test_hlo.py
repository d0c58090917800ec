"""zinf_jax.xla.hlo reads compiled HLO text: transfers (with loop trip counts), overlap, host compute, reductions.
Small modules written by hand in XLA's text format, as a GPU and a TPU compiler leave them."""
from zinf_jax.xla import hlo

GPU = """HloModule m, is_scheduled=true

%body (p: (s32[], f32[2,4]{1,0}, f32[8,4]{1,0:S(5)})) -> (s32[], f32[2,4]{1,0}, f32[8,4]{1,0:S(5)}) {
  %p = (s32[], f32[2,4]{1,0}, f32[8,4]{1,0:S(5)}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %h = f32[2,4]{1,0} get-tuple-element(%p), index=1
  %stack = f32[8,4]{1,0:S(5)} get-tuple-element(%p), index=2
  %ds-start = ((f32[8,4]{1,0:S(5)}, s32[]), f32[1,4]{1,0}, u32[]) fusion-start(%stack, %i), kind=kLoop, calls=%slice
  %compute = f32[2,4]{1,0} fusion(%h), kind=kLoop, calls=%tanh
  %ds-done = f32[1,4]{1,0} fusion-done(%ds-start)
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[2,4]{1,0}, f32[8,4]{1,0:S(5)}) tuple(%next, %compute, %stack)
}

%cond (p: (s32[], f32[2,4]{1,0}, f32[8,4]{1,0:S(5)})) -> pred[] {
  %p = (s32[], f32[2,4]{1,0}, f32[8,4]{1,0:S(5)}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(8)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[8,4], h: f32[2,4]) -> f32[4,4] {
  %a = f32[8,4]{1,0:S(5)} parameter(0)
  %h = f32[2,4]{1,0} parameter(1)
  %c-start = (f32[8,4]{1,0}, f32[8,4]{1,0:S(5)}, u32[]) copy-start(%a)
  %c-done = f32[8,4]{1,0} copy-done(%c-start)
  %zero = s32[] constant(0)
  %init = (s32[], f32[2,4]{1,0}, f32[8,4]{1,0:S(5)}) tuple(%zero, %h, %a)
  %w = (s32[], f32[2,4]{1,0}, f32[8,4]{1,0:S(5)}) while(%init), condition=%cond, body=%body
  %ar = f32[4,4]{1,0} all-reduce(%c-done), to_apply=%add, metadata={op_name="jit(step)/transpose(jvp())/dot_general"}
  %bar = bf16[4,4]{1,0} all-reduce-start(%c-done), to_apply=%add, metadata={op_name="jit(step)/jvp()/reduce_sum"}
  %host = f32[4,4]{1,0} fusion(%ar), kind=kLoop, calls=%neg, frontend_attributes={_xla_compute_type="host"}
  %out-start = (f32[4,4]{1,0:S(5)}, f32[4,4]{1,0}, u32[]) copy-start(%host)
  ROOT %out-done = f32[4,4]{1,0:S(5)} copy-done(%out-start)
}
"""


def test_transfers_are_counted_per_step_with_the_loop_trip_count_and_their_overlap():
    m = hlo.parse(GPU)
    assert m.entry == "main" and m.multiplicity()["body"] == 8  # the trip count read off the loop's condition
    ts = {t.name: t for t in hlo.transfers(m)}
    assert ts["ds-start"].to_device and ts["ds-start"].nbytes == 16 and ts["ds-start"].runs == 8
    assert ts["ds-start"].overlapped  # a fusion runs between its start and its done
    assert ts["c-start"].to_device and not ts["c-start"].overlapped and ts["c-start"].total == 128
    assert not ts["out-start"].to_device and ts["out-start"].total == 64
    s = hlo.summary(m)
    assert s["h2d_bytes"] == 8 * 16 + 128 and s["d2h_bytes"] == 64
    assert s["in_loop_h2d_bytes"] == 128 and s["in_loop_h2d_overlapped"] == 1.0


def test_host_compute_and_reduction_types_are_found():
    m = hlo.parse(GPU)
    assert [h.split(":")[1].split("=")[0].strip() for h in hlo.host_compute(m)] == ["host"]
    reds = {r.name: r for r in hlo.reductions(m)}
    assert reds["ar"].dtypes == ("f32",) and "transpose(" in reds["ar"].op_name
    assert reds["bar"].dtypes == ("bf16",)


def test_a_tpu_loop_without_a_recorded_trip_count_is_read_from_its_induction_variable():
    tpu = GPU.replace("%n = s32[] constant(8)", "%n = s32[] constant(7)").replace(
        "%zero = s32[] constant(0)", "%zero = s32[] constant(1)")  # from 1 to 7 by 1: 6 iterations
    assert hlo.parse(tpu).multiplicity()["body"] == 6
