"""The caching-allocator simulation against the rules of c10/cuda/CUDACachingAllocator.cpp, each
expected figure worked out by hand from them; the loss's tensor order against what PyTorch's
MemTracker records on the trainer's own loss; and the reserved memory the planner derives from
both."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.helpers import storage_log
from zplan import activation_memory, allocator
from zplan.caching_allocator import CachingAllocator
from zplan.scenario_options import build, cpu_ranks
from zplan.units import MiB


def run(seq, expandable=False):
    a = CachingAllocator(expandable)
    for op, key, *rest in seq:
        if op == "+":
            a.malloc(key, rest[0], *rest[1:])
        else:
            a.free(key)
    return a


def test_classic_segments_follow_get_allocation_size():
    # <= 1 MiB: a 2 MiB small segment; < 10 MiB: a 20 MiB one; larger: own, rounded to 2 MiB
    assert run([("+", "a", 1)]).reserved_bytes == 2 * MiB
    assert run([("+", "a", MiB + 1)]).reserved_bytes == 20 * MiB
    assert run([("+", "a", 10 * MiB + 1)]).reserved_bytes == 12 * MiB
    # a second small request shares the first one's 2 MiB segment (split off its remainder)
    a = run([("+", "a", 1000), ("+", "b", 1000)])
    assert a.reserved_bytes == 2 * MiB and a.allocated_bytes == 2048  # 512 B blocks


def test_best_fit_splits_large_blocks_only_past_one_mib():
    # freed 100 MiB serves 30 MiB (the 70 MiB rest is split off and cached); 80 MiB fits nowhere
    a = run([("+", "a", 100 * MiB), ("-", "a"), ("+", "b", 30 * MiB), ("+", "c", 80 * MiB)])
    assert a.reserved_bytes == 180 * MiB
    # a rest of exactly 1 MiB is not split off (remaining > kSmallSize): the block is used whole
    a = run([("+", "a", 100 * MiB), ("-", "a"), ("+", "b", 99 * MiB)])
    assert a.allocated_bytes == 100 * MiB
    # the smallest block that fits is taken, not the first (x, 1 MiB, is the small pool's)
    a = run([("+", "a", 50 * MiB), ("+", "x", 1 * MiB), ("+", "b", 30 * MiB), ("-", "a"), ("-", "b"),
             ("+", "c", 30 * MiB), ("+", "d", 50 * MiB)])
    assert a.reserved_bytes == 50 * MiB + 2 * MiB + 30 * MiB


def test_freed_neighbours_merge_within_their_segment():
    # two halves of one 100 MiB segment, freed, serve a 100 MiB request again
    a = run([("+", "a", 100 * MiB), ("-", "a"), ("+", "b", 40 * MiB), ("+", "c", 60 * MiB),
             ("-", "b"), ("-", "c"), ("+", "d", 100 * MiB)])
    assert a.reserved_bytes == 100 * MiB
    # blocks of two segments never merge: 40 + 60 MiB cached cannot serve 100 MiB
    a = run([("+", "a", 40 * MiB), ("+", "b", 60 * MiB), ("-", "a"), ("-", "b"), ("+", "c", 100 * MiB)])
    assert a.reserved_bytes == 200 * MiB


def test_a_stream_reuses_only_its_own_blocks():
    a = run([("+", "a", 100 * MiB, "s1"), ("-", "a"), ("+", "b", 100 * MiB, "s2")])
    assert a.reserved_bytes == 200 * MiB
    a = run([("+", "a", 100 * MiB, "s1"), ("-", "a"), ("+", "b", 100 * MiB, "s1")])
    assert a.reserved_bytes == 100 * MiB


def test_expandable_segments_grow_at_the_end_in_20_mib_pages():
    # 30 MiB maps two pages; freed, it is the free block at the segment's end: 50 MiB extends it
    # by one page rather than mapping 50 more
    a = run([("+", "a", 30 * MiB), ("-", "a"), ("+", "b", 50 * MiB)], expandable=True)
    assert a.reserved_bytes == 60 * MiB
    assert run([("+", "a", 30 * MiB), ("-", "a"), ("+", "b", 50 * MiB)]).reserved_bytes == 80 * MiB
    # neighbouring allocations across what were two classic segments merge when freed
    a = run([("+", "a", 40 * MiB), ("+", "b", 60 * MiB), ("-", "a"), ("-", "b"), ("+", "c", 100 * MiB)],
            expandable=True)
    assert a.reserved_bytes == 100 * MiB
    # small requests map 2 MiB pages of their own pool
    assert run([("+", "a", 1000)], expandable=True).reserved_bytes == 2 * MiB


def test_expandable_best_fit_keeps_the_growable_end_block_for_last():
    # a 40 MiB hole in the middle and a 40 MiB free block at the end: a 30 MiB request takes the
    # hole (get_free_block's expandable_size), so 45 MiB can still grow the end block
    seq = [("+", "a", 40 * MiB), ("+", "x", 20 * MiB), ("+", "b", 40 * MiB), ("-", "a"), ("-", "b"),
           ("+", "c", 30 * MiB), ("+", "d", 45 * MiB)]
    assert run(seq, expandable=True).reserved_bytes == 120 * MiB


def _steps(**kw):
    sc = build(cpu_ranks(model="llama-3.1-8b", gpus="8", seq_len=8192, micro_batch=2, **kw))
    return sc, activation_memory.loss_steps(sc.train)


@pytest.mark.parametrize("expandable", [False, True])
def test_a_dropped_logits_tensor_leaves_a_hole_in_the_loss(expandable):
    """The eager loss with bf16 logits upcast (E logits, all in the large pool): logits 2E, fp32
    copy 4E and log_softmax's output 4E take 10E; the copy and (dropped) the logits free a 6E
    block below the output; nll's gradient (4E) takes it, log_softmax's input gradient (4E) fits
    in neither the 2E left nor anywhere else: 14E reserved for a 12E peak. Logits kept: the copy's
    4E block takes nll's gradient exactly, 14E reserved for a 14E peak."""
    sc, _ = _steps(logits_kept=False)
    E = 2 * 8192 * 128256
    t = sc.train
    dropped = allocator.loss_reserved_bytes(E, t, True, expandable)
    kept = allocator.loss_reserved_bytes(E, t.model_copy(update={"logits_kept": True}), True, expandable)
    page = 20 * MiB if expandable else 2 * MiB
    assert dropped == pytest.approx(14 * E, abs=4 * page)
    assert activation_memory.loss_bytes_per_logit(t)["backward"] == 12
    assert kept == pytest.approx(14 * E, abs=4 * page)
    assert activation_memory.loss_bytes_per_logit(t.model_copy(update={"logits_kept": True}))["backward"] == 14
    # compiled: the logits and their gradient only, no hole
    compiled = t.model_copy(update={"compile_loss": True})
    assert allocator.loss_reserved_bytes(E, compiled, True, expandable) == pytest.approx(4 * E, abs=2 * page)


def test_the_planner_reserves_the_loss_hole_on_the_default_stream():
    """torchtitan's Llama 3.1 8B run (8 GPUs, seq 8192 x 2, logits dropped): the default stream
    reserves its holdings at the loss and the 14E the loss's tensors take, 2E (3.9 GiB) above its
    allocated peak; with the logits kept, no hole. With classic segments, beside them, the blocks
    selective checkpointing's forward freed (SwiGLU's three unkept MLP-wide tensors, each
    s·b·f·2 bytes), which the loss's tensors do not fit. Neither the forward's blocks nor the
    dropped logits' own segment (log_softmax's input gradient, 4E, does not fit its 2E) counts
    towards "fits": they are segments wholly free when the reserve peaks, which the allocator
    releases before failing; the holes the forward leaves beside what its blocks keep
    (allocator.forward_holes) are not."""
    from zplan.estimate import estimate_one
    from zplan.memory import timeline
    from zplan.memory_reserve import forward_holes
    from zplan.strategies import effective

    E = 2 * 8192 * 128256
    sb, h, f = 2 * 8192, 4096, 14336
    st = effective("zero3", "torch")
    for kept in (False, True):
        sc = build(cpu_ranks(model="llama-3.1-8b", gpu="h100-sxm", gpus="8", seq_len=8192,
                             micro_batch=2, logits_kept=kept, fragmentation=None,
                             embed_head_unit="root-kept", checkpointing="selective"))
        m = estimate_one(sc, "zero3").memory
        free, largest, whole = forward_holes(sc.for_strategy(st.fsdp), st)
        # the last block's working set at least (SwiGLU's three unkept MLP-wide tensors, each
        # s·b·f·2 bytes, its own segment), and holes beside it; the loss's tensors fit none
        assert whole >= 3 * sb * f * 2 and free > whole and largest < E
        hole = (0 if kept else 2 * E) + free
        per = allocator.stream_peaks(timeline(sc, st))
        assert m.peak_phase == "loss"
        others = sum(allocator.segment_bytes(b) for s, b in per.items() if s != "default" and b)
        assert m.reserved_bytes - others == pytest.approx(per["default"] + hole, abs=8 * MiB)
        assert m.releasable_bytes == pytest.approx(whole + (0 if kept else 2 * E), abs=8 * MiB)


@pytest.mark.slow  # over a second in all: the fast loop leaves it to CI
def test_loss_steps_are_the_order_pytorch_makes_and_frees_the_loss_tensors(tmp_path):
    """The trainer's own loss (trainer/micro_batch.forward_loss on bf16 logits) under PyTorch's
    MemTracker, every storage's allocation and release in order: the vocabulary-sized ones, in
    logits, are activation_memory.loss_steps, logits dropped or kept, from the head's dtype or
    upcast by the model (`logits_fp32`)."""
    torch = pytest.importorskip("torch")
    from zplan import presets
    from zplan.trainer.micro_batch import forward_loss
    from zplan.trainer.model import Transformer
    from zplan.trainer.parallel import Parallelized

    path = tmp_path / "m.toml"
    path.write_text('name = "vocab-heavy"\nnum_layers = 1\nhidden = 64\nffn_hidden = 128\n'
                    'num_heads = 4\nnum_kv_heads = 2\nvocab_size = 8192\nmax_seq_len = 64\n'
                    'source = "test"\n')
    for kept, fp32 in ((False, False), (True, False), (False, True), (True, True)):
        sc = build(cpu_ranks(model=str(path), gpus="1", seq_len=64, micro_batch=2, logits_kept=kept,
                             logits_fp32=fp32))
        E = 2 * 64 * 8192
        torch.manual_seed(0)
        model = Transformer(presets.model(str(path))).to(torch.bfloat16)
        p = Parallelized(model, model, False, [], None)
        x = torch.randint(0, 8192, (2, 64))
        def step():
            loss, _ = forward_loss(p, sc.train, x, x, sync=True)
            loss.backward()

        log = storage_log(step)
        names, seq = {}, []
        for op, key, b in log:
            if b >= 2 * E and op in ("ADD", "DEL"):
                name = names.setdefault(key, len(names))
                seq.append(("+" if op == "ADD" else "-", name, b // E))
        expected = activation_memory.loss_steps(sc.train)
        order = {}
        got = [(op, per) for op, _, per in seq[:len(expected)]]
        assert got == [(op, b) for _, op, _, b in expected]
        # and the same tensors: each one freed is the one made under that name
        for (_, op, tname, _), (_, idx, _) in zip(expected, seq):
            assert order.setdefault(tname, idx) == idx


def test_reserved_flags_go_with_fake(capsys):
    from tests.helpers import cli

    for flags in (["--reserved"], ["--expandable-segments"], ["--no-logits-kept"],
                  ["--embed-head-unit", "root-kept"], ["--logits-fp32"], ["--last-block-kept"]):
        r = cli(capsys, "verify", *flags)
        assert r.returncode == 2 and "--fake" in r.stderr and "Traceback" not in r.stderr
    r = cli(capsys, "verify", "--fake", "--expandable-segments")
    assert r.returncode == 2 and "--reserved" in r.stderr
    r = cli(capsys, "verify", "--fake", "--embed-head-unit", "rooot")
    assert r.returncode == 2 and "rooot" in r.stderr and "Traceback" not in r.stderr
    r = cli(capsys, "verify", "--fake", "--logits-fp32", "--linear-loss", "chunked")
    assert r.returncode == 2 and "drop --logits-fp32" in r.stderr and "Traceback" not in r.stderr


def test_expandable_segments_is_an_assumption_anyone_can_change(capsys):
    import json

    from tests.helpers import cli

    base = ["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--seq-len", "8192", "--layout",
            "torch", "--strategy", "zero3", "--json"]
    plain = json.loads(cli(capsys, *base).stdout)
    exp = json.loads(cli(capsys, *base, "--expandable-segments").stdout)
    assert plain["assumptions"]["expandable_segments"]["value"] is False
    assert exp["assumptions"]["expandable_segments"]["value"] is True
    # and it is priced: each stream's pool mapped in whole 20 MiB pages, not 2 MiB-rounded segments
    reserved = [d["strategies"][0]["per_gpu"]["reserved_bytes"] for d in (plain, exp)]
    assert reserved[1] % (20 * MiB) == 0 and reserved[0] % (2 * MiB) == 0 and reserved[0] != reserved[1]


def test_one_rank_copies_in_on_the_default_stream():
    """A shard group of one rank copies each shard in on the current stream (FSDPParamGroup.
    wait_for_unshard, torch 2.13): no all-gather stream, so no segment of its own; the copy is
    counted with the gathered weights."""
    from zplan.memory import timeline
    from zplan.strategies import effective

    sc = build(cpu_ranks(model="llama-3.2-1b", gpu="h100-sxm", gpus="1", seq_len=2048, fragmentation=None))
    per = allocator.stream_peaks(timeline(sc, effective("zero3", "torch")))
    assert per["all-gather"] == 0 and per["default"] > 0
    two = build(cpu_ranks(model="llama-3.2-1b", gpu="h100-sxm", gpus="2", seq_len=2048, fragmentation=None))
    assert allocator.stream_peaks(timeline(two, effective("zero3", "torch")))["all-gather"] > 0


@pytest.mark.parametrize("expandable,want_mib", [(False, 5516), (True, 5522)])
def test_the_heads_reduce_scatter_input_fits_no_block_the_loss_freed(expandable, want_mib):
    """Llama 3.1 8B at seq 2048, its head a unit of its own (FSDP2, resharded after forward):
    logits L = 501 MiB, fp32 copy F, log_softmax output P and both gradients N, Q 1002 MiB; the
    head's weights W and weight gradient G 1002 MiB, the norm's and its gradient 8 KiB each (one
    tensor per parameter: FSDP2's all-gather outputs and autograd's gradients; the small pool's
    one 2 MiB segment), input gradient 16 MiB, reduce-scatter input R 2004 MiB + 16 KiB in fp32
    (one flat tensor). Worked by hand from CUDACachingAllocator's rules: classic -- W's 1002 MiB
    segment serves F, then N, then the logits' gradient (501 of it); P's and Q's serve W and G
    again; R takes a segment of its own: 1002 + 2 + 502 + 1002 + 1002 + 2006 = 5516 MiB.
    Expandable (20 MiB pages) -- the segment reaches 3520 MiB with Q (W, L, P, Q each extending
    it); W again takes P's freed 1002 over the growable 1015 at the end, the input gradient the
    501 the logits' gradient left, G the end's 1015, and R grows the 13 left by 100 pages: 5520
    + 2 = 5522 MiB. Before 2026-12-07 the head's weights and gradient were one tensor each,
    8 KiB over the blocks of 1002 MiB the loss frees at this sequence length, so each took a
    segment of its own: 6520 / 5040 MiB, 0.9 GiB over the allocator replayed over a traced step
    at full checkpointing (docs/reserved-matrix.md). Without the head's tensors: 3508 / 3520 MiB."""
    sc = build(cpu_ranks(model="llama-3.1-8b", gpus="8", seq_len=2048, micro_batch=1))
    E, w, n = 2048 * 128256, 128256 * 4096 * 2, 4096 * 2
    head = allocator.HeadTail((n, w), (n, w), 2048 * 4096 * 2, 2 * (w + n))
    assert allocator.loss_reserved_bytes(E, sc.train, True, expandable, head) == want_mib * MiB
    assert allocator.loss_reserved_bytes(E, sc.train, True, expandable) == (3520 if expandable else 3508) * MiB
    # the planner reads these sizes from the head unit as FSDP2 shards it
    from zplan.memory import model_state
    from zplan.memory_reserve import head_tail
    from zplan.strategies import effective

    st = effective("zero3", "torch")
    planned = head_tail(sc, st, model_state(sc, st))
    assert replace(planned, last_weights_bytes=0, last_grad_bytes=0, last_reduce_in_bytes=0,
                   freed_block_bytes=0) == head
    # the embedding, reduced last (gathered again: 1002 MiB weights, then a 1002 MiB gradient,
    # a 2004 MiB fp32 input), takes the blocks the head's own gradient and reduce-scatter input
    # left: the end of backward adds nothing
    assert (planned.last_weights_bytes, planned.last_grad_bytes, planned.last_reduce_in_bytes) == ((w,), (w,), 2 * w)
    assert not planned.held_root and planned.freed_block_bytes == 2048 * 14336 * 2
    assert allocator.loss_reserved_bytes(E, sc.train, True, expandable, planned) == \
        allocator.loss_reserved_bytes(E, sc.train, True, expandable, replace(planned, last_reduce_in_bytes=0))
    kept = build(cpu_ranks(model="llama-3.1-8b", gpus="8", seq_len=2048, embed_head_unit="head-kept"))
    assert head_tail(kept, st, model_state(kept, st)).weights_bytes == 0  # not gathered again


@pytest.mark.parametrize("expandable,want_mib", [(False, 7518), (True, 6544)])
def test_a_held_roots_reduce_scatter_input_fits_no_block_at_the_end_of_backward(expandable, want_mib):
    """Llama 3.1 8B at seq 2048, embedding, norm and head one root kept gathered (torchtitan's
    layout until 2025-07), logits dropped before backward (eager loss): the root's
    reduce-scatter input R = 4008 MiB + 16 KiB (fp32, the norm's weight the 16 KiB) comes at the
    end of backward, with the head's gradient G (1002 MiB, held since the head's backward) and
    the embedding's E (1002 MiB). The blocks' activations A (here their largest tensor, 56 MiB)
    are alive through the loss and free at the end; their bytes are taken off the result.
    Worked by hand from CUDACachingAllocator's rules. Classic -- A takes a 56 MiB segment; the
    loss leaves segments of 502 (logits, then their gradient), 1002 (fp32 copy, then nll's
    gradient), 1002 (log_softmax) and 1002 MiB (its gradient); the head's input gradient splits
    the first 1002, G takes the second; at the end E takes the first 1002 again and R fits
    nothing: a segment of its own, rounded to 4010 MiB: 56 + 502 + 3 x 1002 + 4010 - 56 = 7518.
    Expandable (20 MiB pages) -- A [0, 56); the loss ends with its logits' gradient at [56, 557)
    and [557, 3580) free at the end; the input gradient and G take [557, 1575); at the end E
    takes [1575, 2577) and R extends the 1003 MiB left at the end by 151 pages: 3580 + 3020 - 56
    = 6544 MiB. Accumulating (G and E added into the accumulated gradients before R): all of
    [0, 3580) is free, R extends it by 22 pages, 3964 MiB. Tied (E added into G in place, as a
    linear loss's G takes it): R extends [1575, 3580) by 101 pages, 5544 MiB. Tied under a plain
    head, whose G is a transpose's view, so autograd adds out of place: the sum S takes [2577,
    3579), G and E go, R extends the 1 MiB left at the end by 201 pages: 3580 + 4020 - 56 = 7544;
    classic: S takes the third 1002 MiB segment, 7518 as before."""
    from zplan.memory import model_state
    from zplan.memory_reserve import head_tail
    from zplan.strategies import effective

    sc = build(cpu_ranks(model="llama-3.1-8b", gpus="8", seq_len=2048, embed_head_unit="root-kept",
                         logits_kept=False))
    E, g = 2048 * 128256, 128256 * 4096 * 2
    head = allocator.HeadTail(0, g, 2048 * 4096 * 2, 0, last_grad_bytes=g,
                              last_reduce_in_bytes=(2 * 128256 + 1) * 4096 * 4,
                              freed_block_bytes=2048 * 14336 * 2, held_root=True)
    assert allocator.loss_reserved_bytes(E, sc.train, True, expandable, head) == want_mib * MiB
    st = effective("zero3", "torch")
    assert head_tail(sc, st, model_state(sc, st)) == head
    # without the end of backward, the loss and the head's backward alone (with A: 3524 = 3580 - 56)
    assert allocator.loss_reserved_bytes(E, sc.train, True, expandable, replace(head, last_reduce_in_bytes=0)) == \
        (3524 if expandable else 3508) * MiB
    for flags, mib in ((("accumulating",), 3964), (("tied",), 5544), (("tied", "tied_out_of_place"), 7544),
                       (("tied", "tied_out_of_place", "accumulating"), 3964)):
        got = allocator.loss_reserved_bytes(E, sc.train, True, expandable, replace(head, **dict.fromkeys(flags, True)))
        assert got == (mib if expandable else 7518) * MiB, flags
    # freed activations that hold the embedding's gradient and the root's input (one 8 GiB
    # tensor, or an expandable segment's 8 GiB of them) leave the end of backward nothing to add
    roomy = replace(head, freed_block_bytes=8 << 30)
    assert allocator.loss_reserved_bytes(E, sc.train, True, expandable, roomy) == allocator.loss_reserved_bytes(
        E, sc.train, True, expandable, replace(roomy, last_grad_bytes=0, last_reduce_in_bytes=0))


@pytest.mark.parametrize("expandable,want_mib", [(False, 5028), (True, 5022)])
def test_under_a_linear_loss_the_head_and_the_end_of_backward_are_simulated(expandable, want_mib):
    """A linear (chunked) loss makes no logits, but the root's 4 GiB reduce-scatter input still
    comes at the end of backward. The head's weight gradient G (1002 MiB) is made in the loss's
    forward (counted with what the stream holds at the loss: taken off, as the activations A).
    By hand, classic: A 56, G 1002, the head's input gradient 16, each a segment of its own; at
    the end E (1002) and R (4010) fit none: 56 + 1002 + 16 + 1002 + 4010 - 56 - 1002 = 5028 MiB.
    Expandable: A [0, 56), G [56, 1058), the input gradient [1058, 1074); E extends the 22 MiB
    free at the end by 49 pages to 2060, R by 201 more: 6080 - 56 - 1002 = 5022 MiB. Before,
    a linear loss priced no hole at all (Llama 3.1 8B, root kept, seq 2048: -15% and -18%
    against the replay of traced steps with and without checkpointing, now -5% and -9%)."""
    from zplan.memory import model_state
    from zplan.memory_reserve import head_tail
    from zplan.strategies import effective

    sc = build(cpu_ranks(model="llama-3.1-8b", gpus="8", seq_len=2048, embed_head_unit="root-kept",
                         linear_loss="chunked"))
    g = 128256 * 4096 * 2
    head = allocator.HeadTail(0, g, 2048 * 4096 * 2, 0, last_grad_bytes=g,
                              last_reduce_in_bytes=(2 * 128256 + 1) * 4096 * 4,
                              freed_block_bytes=2048 * 14336 * 2, held_root=True)
    st = effective("zero3", "torch")
    assert head_tail(sc, st, model_state(sc, st)) == head
    assert allocator.loss_reserved_bytes(0, sc.train, True, expandable, head) == want_mib * MiB
    assert allocator.loss_reserved_bytes(0, sc.train, True, expandable, None) == 0


def test_a_resharding_roots_weights_stay_gathered_to_its_own_reshard():
    """The same root resharding after forward (embed_head_unit root): gathered again (two
    tensors of 1002 MiB and the norm's 8 KiB in bf16, one per parameter) for the head's
    backward, it reshards only in its post-backward, after the embedding's gradient, before its
    reduce-scatter input (FSDPParamGroup.post_backward). By hand, classic: A 56; the embedding
    weight 1002, the norm's in the small pool's 2, the head's 1002 (freed after the forward,
    they take the fp32 copy and log_softmax, then nll's gradient); logits 502 (then their
    gradient); log_softmax's gradient 1002; the weights again in their own two; the input
    gradient splits the third 1002, G a new 1002; at the end E takes that third one again, the
    weights are freed and R takes 4010: 56 + 1002 + 2 + 1002 + 502 + 1002 + 1002 + 4010 - 56 =
    8522 MiB (the total it was with the root's weights one tensor of 2006)."""
    from zplan.memory import model_state
    from zplan.memory_reserve import head_tail
    from zplan.strategies import effective

    sc = build(cpu_ranks(model="llama-3.1-8b", gpus="8", seq_len=2048, embed_head_unit="root",
                         logits_kept=False))
    st = effective("zero3", "torch")
    head = head_tail(sc, st, model_state(sc, st))
    assert head.held_root and head.weights_bytes == (128256 * 4096 * 2, 4096 * 2, 128256 * 4096 * 2)
    assert allocator.loss_reserved_bytes(2048 * 128256, sc.train, True, False, head) == 8522 * MiB


def test_the_largest_block_tensor_is_the_mlps_hidden_or_the_attention_probabilities():
    """A dense SwiGLU block's largest tensor is one of its MLP-wide outputs, s·b·f in bf16; with
    the math attention path, the attention probabilities a·s²·b are larger at long sequences."""
    from zplan.activation_memory import largest_block_tensor_bytes

    sc = build(cpu_ranks(model="llama-3.1-8b", gpus="8", seq_len=2048, micro_batch=2))
    assert largest_block_tensor_bytes(sc.model, sc.train) == 2048 * 2 * 14336 * 2
    math = build(cpu_ranks(model="llama-3.1-8b", gpus="8", seq_len=2048, flash=False))
    assert largest_block_tensor_bytes(math.model, math.train) == 32 * 2048 * 2048 * 2


@pytest.mark.parametrize("kept,want_mib", [(False, (5520, 4540)), (True, (5520, 5520))])
def test_a_compiled_loss_frees_its_logits_before_the_heads_backward(kept, want_mib):
    """Compiled (or fused) loss, same head as above: the loss saves the logits (501 MiB) and
    writes their gradient; where the loop holds none (`del pred`) they are freed when the loss's
    backward ends, before the head's. Expandable, by hand: their block joins the free end, which
    the regathered weights then take; G extends the end (51 pages), R (2004 MiB) extends it by
    100 pages: 4540 MiB. Held by the loop: 5520. Classic: 1004 + 502 + 1004 + 1004 + 2006 = 5520
    either way (the logits' 502 MiB segment serves only the input gradient)."""
    sc = build(cpu_ranks(model="llama-3.1-8b", gpus="8", seq_len=2048, compile=True, logits_kept=kept))
    E, w = 2048 * 128256, 128256 * 4096 * 2 + 4096 * 2
    head = allocator.HeadTail(w, w, 2048 * 4096 * 2, 2 * w)
    got = tuple(allocator.loss_reserved_bytes(E, sc.train, True, e, head) // MiB for e in (False, True))
    assert got == want_mib


def test_a_held_roots_head_gradient_is_the_head_weights_alone():
    """Embedding and head in one held root (untied): at the head's backward only the head's
    weight gradient exists (the embedding's comes at the end of backward), as the timeline's
    `backward head` event counts it; the whole root is what is gathered again."""
    from zplan.memory import model_state
    from zplan.memory_reserve import head_tail
    from zplan.strategies import effective

    st = effective("zero3", "torch")
    sc = build(cpu_ranks(model="llama-3.1-8b", gpus="8", seq_len=2048, embed_head_unit="root"))
    tail = head_tail(sc, st, model_state(sc, st))
    head_w = 128256 * 4096 * 2
    assert tail.grad_bytes == head_w and tail.reduce_in_bytes == 0
    assert tail.weights_bytes == (head_w, 4096 * 2, head_w)  # embedding, norm and head, one tensor each


@pytest.mark.parametrize("checkpointing,expandable,adds", [
    ("none", False, True), ("full", False, True), ("none", True, False), ("full", True, True)])
def test_the_planner_prices_the_end_of_backward_where_freed_activations_do_not_hold_it(
        monkeypatch, checkpointing, expandable, adds):
    """Llama 3.1 8B, root kept, seq 2048 on 8 GPUs. Classic segments: the root's 4 GiB input
    fits none of the activations' segments (56 MiB at most), with or without checkpointing.
    Expandable: the planner frees all the activations alive at the loss as one region -- 20 GB
    without checkpointing hold it, the 0.6 GB of block inputs under full checkpointing do not."""
    from zplan import memory as mem
    from zplan import memory_reserve as reserve
    from zplan.strategies import effective

    sc = build(cpu_ranks(model="llama-3.1-8b", gpu="h100-sxm", gpus="8", seq_len=2048,
                         embed_head_unit="root-kept", logits_kept=False, checkpointing=checkpointing,
                         fragmentation=None, expandable_segments=expandable))
    st = effective("zero3", "torch")
    reserve.loss_reserve.cache_clear()
    with_end = mem.memory(sc, st).reserved_bytes
    monkeypatch.setattr(allocator, "_backward_end", lambda sim, head: None)
    reserve.loss_reserve.cache_clear()
    without = mem.memory(sc, st).reserved_bytes
    reserve.loss_reserve.cache_clear()
    assert (with_end > without + (1 << 30)) if adds else with_end == without


def test_a_linear_losss_weight_gradient_is_not_counted_among_the_freed_activations(monkeypatch):
    """With expandable segments the planner frees the activations alive at the loss as one
    region by the end of backward; a linear loss's weight gradient (B·V·h, 1002 MiB for Llama
    3.1 8B) is alive then too -- a held root keeps it to its reduce-scatter -- so it is not in
    that region: it is simulated on its own (5022 MiB by hand, above)."""
    from zplan import memory as mem
    from zplan import memory_reserve as reserve
    from zplan.memory_timeline import activations
    from zplan.strategies import effective

    sc = build(cpu_ranks(model="llama-3.1-8b", gpu="h100-sxm", gpus="8", seq_len=2048, embed_head_unit="root-kept",
                         linear_loss="chunked", checkpointing="full", fragmentation=None, expandable_segments=True))
    st = effective("zero3", "torch")
    seen = []
    real = allocator.loss_reserve
    monkeypatch.setattr(allocator, "loss_reserve", lambda *a: seen.append(a[-1]) or real(*a))
    reserve.loss_reserve.cache_clear()
    m = mem.memory(sc, st)
    reserve.loss_reserve.cache_clear()
    fsdp = sc.for_strategy(True)
    start = next(e for e in mem.timeline(fsdp, st) if e.label == "loss forward")
    kept = activations(fsdp).linear_loss["kept"]
    assert kept == 128256 * 4096 * 2 and seen[0].held_root
    assert seen[0].freed_block_bytes == start.live["activations"] - kept
    assert m.reserved_bytes > m.allocated_bytes


def test_the_segments_wholly_free_at_the_reserves_peak_are_releasable():
    """CUDACachingAllocator.cpp's release_cached_blocks hands back to the driver the segments
    with no block in use, then retries the cudaMalloc that failed: at the peak those are what a
    run near the GPU's limit does without. A segment with one block in use is not releasable. In
    expandable segments release_blocks unmaps the whole pages inside each free block instead
    (the next test)."""
    sim = CachingAllocator(track_releasable=True)
    sim.malloc("a", 100 * MiB)
    sim.malloc("b", 50 * MiB)
    sim.malloc("c", 60 * MiB)
    sim.free("b")  # a wholly free 50 MiB segment
    sim.malloc("d", 40 * MiB)  # fits b's segment: split, so no longer wholly free
    sim.free("c")  # 60 MiB wholly free
    sim.malloc("e", 200 * MiB)  # a new segment, the peak: 410 MiB reserved
    assert sim.peak_reserved_bytes == 410 * MiB
    assert sim.releasable_at_peak_bytes == 60 * MiB
    sim.free("e")
    sim.malloc("f", 150 * MiB)  # fits e's segment: no new peak, the figure stands
    assert sim.releasable_at_peak_bytes == 60 * MiB
    assert CachingAllocator().releasable_at_peak_bytes == 0
    ex = CachingAllocator(expandable_segments=True, track_releasable=True)
    ex.malloc("a", 100 * MiB)
    ex.free("a")
    ex.malloc("b", 300 * MiB)
    assert ex.releasable_at_peak_bytes == 0


def test_expandable_segments_release_the_whole_pages_inside_free_blocks():
    """release_blocks -> unmap_block -> ExpandableSegment::unmap unmaps from the first page
    boundary at or above a free block's start to the last at or below its end (20 MiB pages in
    the large pool), by hand: a (30 MiB) at [0, 30), b (50) at [30, 80), c (20) at [80, 100);
    a and c freed, d (150) extends the segment past c's free tail block: the peak, 240 MiB
    mapped. Free then: a's [0, 30) holds one whole page [0, 20); nothing else is free (c's
    block merged into d's). A free block inside one page releases nothing."""
    ex = CachingAllocator(expandable_segments=True, track_releasable=True)
    ex.malloc("a", 30 * MiB)
    ex.malloc("b", 50 * MiB)
    ex.malloc("c", 20 * MiB)
    ex.free("a")
    ex.free("c")
    ex.malloc("d", 150 * MiB)
    assert ex.peak_reserved_bytes == 240 * MiB
    assert ex.releasable_at_peak_bytes == 20 * MiB
    one = CachingAllocator(expandable_segments=True, track_releasable=True)
    one.malloc("a", 10 * MiB)
    one.malloc("b", 5 * MiB)  # [10, 15) of the first 20 MiB page
    one.free("a")  # [0, 10): inside one page, none of it unmappable
    one.malloc("c", 30 * MiB)  # the peak: 40 + 20 MiB mapped
    assert one.peak_reserved_bytes == 60 * MiB and one.releasable_at_peak_bytes == 0


def test_unmappable_pages_are_counted_per_segment_and_per_pool():
    """The same rule on a second stream's segment (its own base, pages counted from it) and in
    the small pool (2 MiB pages), by hand: stream x: a (30 MiB) [0, 30), b (10) [30, 40), a freed:
    one 20 MiB page free. Default stream, small pool: 512 blocks of 1 MiB fill 256 pages of 2 MiB;
    freeing blocks 1-4 leaves [1, 5) MiB free: one whole page, [2, 4). A wholly free expandable
    segment counts its pages once (not also as a wholly free classic segment)."""
    ex = CachingAllocator(expandable_segments=True, track_releasable=True)
    ex.malloc("a", 30 * MiB, "x")
    ex.malloc("b", 10 * MiB, "x")
    ex.free("a")
    for i in range(512):
        ex.malloc(("s", i), MiB)
    for i in range(1, 5):
        ex.free(("s", i))
    assert ex.unmappable_bytes() == 20 * MiB + 2 * MiB
    ex.free("b")  # stream x's segment wholly free: its 40 MiB, once
    assert ex.unmappable_bytes() == 40 * MiB + 2 * MiB
    assert ex.wholly_free_bytes() == 0


def test_the_fragmentation_assumption_quotes_the_reserved_matrix_shipped():
    """estimate's fragmentation assumption states the planner's error against the allocator
    replayed over traced steps; the figures are docs/reserved-matrix.md's summary line (the
    script that writes it, benchmarks/reserved_matrix.py), not a copy left behind by a change."""
    import re
    from pathlib import Path

    from zplan.estimate import assumptions

    doc = (Path(__file__).parent.parent / "docs/reserved-matrix.md").read_text()
    meaning = assumptions(build(cpu_ranks(model="llama-3.1-8b", gpus="8")))["fragmentation"]["meaning"]
    for name, quoted in (("classic", "classic segments"), ("expandable", "expandable ones")):
        mean, lo, hi = re.search(name + r" segments: mean error ([+-][0-9.]+%), from ([+-][0-9.]+%) to "
                                 r"([+-][0-9.]+%)", doc).groups()
        assert f"from {lo} to {hi} with {quoted}, mean {mean}" in meaning, (name, mean, lo, hi, meaning)


def test_each_parameter_is_gathered_padded_to_the_shard_degree():
    """FSDP2 pads each parameter's dim 0 to the shard degree (FSDPParam: torch.chunk's first
    chunk, times the degree) and gathers it into a storage of its own: on 6 ranks Llama 3.1 8B's
    k and v (1024 rows) gather 1026 rows each, the block's other weights divide evenly; the
    parameters' bytes add up to the unit's padded shard (model_state) times the degree."""
    from zplan.memory import model_state
    from zplan.memory_reserve import gathered_param_bytes
    from zplan.strategies import effective

    sc = build(cpu_ranks(model="llama-3.1-8b", gpus="6", seq_len=2048))
    st = effective("zero3", "torch")
    block = next(i for i, u in enumerate(sc.units) if u.blocks)
    got = gathered_param_bytes(sc, st, sc.units[block])
    want = {(4096,): 4098 * 2, (4096, 4096): 4098 * 4096 * 2, (1024, 4096): 1026 * 4096 * 2,
            (14336, 4096): 14340 * 4096 * 2, (4096, 14336): 4098 * 14336 * 2}
    assert got == tuple(want[s] for s in sc.units[block].shapes)
    assert sum(got) == model_state(sc, st).unit_shards[block] * 6 * 2
