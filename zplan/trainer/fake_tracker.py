"""PyTorch's FSDPMemTracker as the fake trace (fake_trace.py) runs it, with what a real run
would not show taken out. Each adjustment keeps the tracker's own accounting and names the
torch 2.13 source it works around:

- DTensor's sharding propagation runs outside the trace's modes, in a fake mode of its own, as
  on a real run (`propagation_outside_trace`): otherwise the global-shape tensors it makes are
  counted (by torch 2.11's tracker even where the propagation has a fake mode of its own).
- Grouped units (`fully_shard([norm, output])`, several blocks per unit) keep FSDP2's group
  forward hooks (`TraceTracker._instrument_fsdp_module`): the tracker's own instrumentation
  registers each module of a group separately, so a group was gathered and reduce-scattered
  once per module.
- Only the global peak is kept, with the phase it was reached in
  (`TraceTracker._update_peak_stats`): the tracker's per-module peaks cost 40% of a trace and
  nothing reads them.
- On a CPU rank's run (`settle_backend_buffers`), a storage the collective backend makes inside
  a c10d call (gloo's clone of a reduce-scatter input) is released when the call returns, not
  when gloo's worker thread happens to drop its last reference (`_made_by_collective`).
- Where asked (`allocations` a list), every storage's allocation, release and resize is recorded
  in order (`TraceTracker._update_snap`), for the caching-allocator simulation
  (fake_trace.simulated_reserved).
- A unit's unsharded gradients are released when FSDP2's reduce clears them
  (`TraceTracker._fsdp_param_group_post_backward`): the tracker's wrapper of
  FSDPParamGroup.post_backward kept the group's last gradient in a loop variable while
  post_backward ran, so foreach_reduce's `unsharded_grads.clear()` did not free it and the
  reduce-scatter output was allocated beside it (a whole unit for an embedding of its own). A
  plain FSDP2 run frees it there (tests/test_fake_trace.py holds both with weak references).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from copy import deepcopy
from functools import lru_cache, wraps


def phase(tracker) -> str:
    """The phase the tracker is in now, from its module stack (ModTracker.parents). No module on
    the stack is the loss (between the root's forward and its backward) until a module's
    backward has run; after that it is backward's end (FSDP2's final callback: the root's
    reduce-scatter), which the loss's label hid (the survey of verify --fake: a peak at the
    embedding's reduce-scatter read as the loss's)."""
    if tracker._in_opt:
        return "optimizer"
    mt = tracker._mod_tracker
    if not (set(mt.parents) - {"Global"}):
        return "backward" if getattr(tracker, "_zplan_backward_seen", False) else "loss"
    return "backward" if mt.is_bw else "forward"


def note_moment(tracker) -> None:
    """At every allocation: whether the last moment inside a module was in its backward (phase's
    test for a moment outside every module; autograd's graph task is live through the loss's
    backward too, so is_bw alone cannot tell the loss from backward's end)."""
    mt = tracker._mod_tracker
    if set(mt.parents) - {"Global"}:
        tracker._zplan_backward_seen = mt.is_bw


@contextlib.contextmanager
def propagation_outside_trace():
    """DTensor's sharding propagation derives each op's output metadata by running the op on
    global-shape fake tensors in `detect_fake_mode() or FakeTensorMode()`
    (torch/distributed/tensor/_sharding_prop.py, _propagate_tensor_meta_non_cached). On a real
    run no mode is active, so it runs in a fake mode of its own, which torch 2.13's
    FSDPMemTracker skips (it counts only ops under the fake mode it was entered in:
    fsdp2_mem_tracker.py __torch_dispatch__, `_fake_mode_on_entry`, as MemTracker's in
    mem_tracker.py); torch 2.11's counts every op it sees. Under the trace's FakeTensorMode,
    the propagation would find that mode and the tracker would count full-size, unsharded
    copies of a parameter (three fp32 copies of the vocabulary matrix in AdamW's step: 12.6 GB
    for Llama 3.1 70B). So it runs as on a real run: with every mode of the trace (the fake mode
    and the tracker) set aside (torch.utils._python_dispatch `_disable_current_modes`, in 2.11
    and 2.13 alike), in a fake mode of its own."""
    from torch.distributed.tensor import _sharding_prop
    from torch.utils._python_dispatch import _disable_current_modes

    prop = getattr(_sharding_prop, "ShardingPropagator", None)
    saved = getattr(_sharding_prop, "detect_fake_mode", None)
    run = getattr(prop, "_propagate_tensor_meta_non_cached", None)
    if saved is None or run is None:  # another torch: nothing to redirect
        yield
        return

    def outside(self, op_schema):
        with _disable_current_modes():
            return run(self, op_schema)

    _sharding_prop.detect_fake_mode = lambda *_a, **_k: None
    prop._propagate_tensor_meta_non_cached = outside
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = saved
        prop._propagate_tensor_meta_non_cached = run


_STATE_NAMES = ("_pre_forward_hook_handle", "_post_forward_hook_handle", "_modules",
                "_modules_to_run_forward", "_pre_forward", "_post_forward")


def _private_names_present(states, fsdp_state_module) -> bool:
    """Whether this torch has the FSDP2 internals TraceTracker re-registers (torch 2.13's
    FSDPState and _register_group_forward_hooks); checked before any hook is removed."""
    return hasattr(fsdp_state_module, "_register_group_forward_hooks") and all(
        hasattr(state, name) for state, _ in states for name in _STATE_NAMES)


_C10D_FILE = "distributed_c10d.py"


def _made_by_collective() -> bool:
    """Whether the tracker is being told of a storage from inside one of torch.distributed's
    collectives (a frame of distributed_c10d.py on the stack): the backend's own buffer.
    ProcessGroupGloo reduce-scatters an all-reduced clone of the input (the plan counts it on
    CPU ranks: memory_timeline.gloo_reduce_scatter_copies_its_input), made on the calling
    thread and dropped when the call returns, except that gloo's worker thread sometimes holds
    the last reference a few ops longer. Counted until then, a CPU rank's peak moved by one
    unit's reduce-scatter input from run to run (tiny model, zero3, 2 ranks: 32.23 MB, and one
    run in four up to 35.5 MB); released at the call's return it is what the plan times it as.
    It assumes nothing made inside distributed_c10d.py outlives the call: true of the tensor
    collectives FSDP2 and DDP call, not of the object collectives (all_gather_object's unpickled
    tensors), which nothing runs inside the tracked steps."""
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_filename.endswith(_C10D_FILE):
            return True
        f = f.f_back
    return False


@lru_cache(maxsize=1)
def tracker_class():
    """FSDPMemTracker with the adjustments above (a class made on first use: torch is imported
    lazily)."""
    from torch.distributed._tools import fsdp2_mem_tracker as fmt
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType, _SavedFSDPMethods
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, _UpdateType
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_state

    class TraceTracker(FSDPMemTracker):
        peak_phase: str | None = None
        allocations: list | None = None  # (op, _WeakRefInfo, bytes now) if recording
        settle_backend_buffers: bool = False  # a real CPU run's (_made_by_collective)

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._backend_pending: list = []  # storages a collective made, not yet released
            self._snap_lock = threading.RLock()  # re-entrant: a release can run inside an update

        def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
            """MemTracker._update_snap, and the change recorded: ADD (a new storage), DEL (freed),
            SIZE (resized: FSDP2 frees and re-allocates unsharded parameters with resize_);
            REF only relabels a storage. Where `settle_backend_buffers` is set (a CPU rank's
            run), a storage the collective backend makes inside a c10d call is released when
            the call has returned, whichever thread drops it last (_made_by_collective). One
            update at a time: gloo's thread releases storages beside the main thread's updates."""
            with self._snap_lock:
                if self.settle_backend_buffers:
                    pending = self._backend_pending
                    inside = None  # _made_by_collective(), walked once and only where it is asked
                    if pending and threading.current_thread() is threading.main_thread():
                        inside = _made_by_collective()
                        if not inside:
                            for w in pending:
                                w.zplan_settled = True
                                self._apply_snap(_UpdateType.DEL, w)
                            pending.clear()
                    if u_type is _UpdateType.DEL and getattr(winfo, "zplan_settled", False):
                        return  # released already, when its collective returned
                    if u_type is _UpdateType.ADD and (inside if inside is not None else _made_by_collective()):
                        pending.append(winfo)
                    elif u_type is _UpdateType.DEL and winfo in pending:
                        pending.remove(winfo)
                self._apply_snap(u_type, winfo, old_mem_consumed, old_reftype)

        def _apply_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
            if self.allocations is not None and u_type.name != "REF":
                self.allocations.append((u_type.name, winfo, winfo.mem_consumed))
            note_moment(self)
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)

        def _update_peak_stats(self, _peak_state) -> None:
            """The global part of MemTracker._update_peak_stats (torch/distributed/_tools/
            mem_tracker.py), and the phase of each new peak."""
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = deepcopy(snap)
                    self.peak_phase = phase(self)

        def _instrument_fsdp_module(self) -> None:
            """FSDPMemTracker._instrument_fsdp_module, once per FSDP state rather than once
            per module: a group's forward hooks go back as a group
            (_fsdp_state._register_group_forward_hooks, as FSDPState.init registers them), with
            the tracker's wrappers around them."""
            states = {}
            for module in self._root_mod.modules():
                if isinstance(module, FSDPModule):
                    state = module._get_fsdp_state()
                    if getattr(state, "_fsdp_param_group", None) is not None:
                        states.setdefault(id(state), (state, module))
            if not _private_names_present(states.values(), _fsdp_state):
                # another torch's FSDP2 internals: the tracker's own instrumentation, before any
                # hook is touched (grouped units are then gathered once per module, as in torch)
                return super()._instrument_fsdp_module()
            for state, _ in states.values():
                state._pre_forward_hook_handle.remove()
                if state._post_forward_hook_handle is not state._pre_forward_hook_handle:
                    state._post_forward_hook_handle.remove()
            for state, module in states.values():
                group = state._fsdp_param_group
                self._instrument_fsdp_sharded_params_grads(group)
                pre = self._fsdp_state_pre_forward(module, state._pre_forward)
                post = self._fsdp_state_post_forward(module, state._post_forward)
                if len(state._modules) == 1:
                    state._pre_forward_hook_handle = module.register_forward_pre_hook(
                        pre, prepend=True, with_kwargs=True)
                    state._post_forward_hook_handle = module.register_forward_hook(
                        post, prepend=False, always_call=True)
                else:
                    register = _fsdp_state._register_group_forward_hooks
                    extra = ((state._cast_output_dtype,) if "cast_output_dtype"
                             in inspect.signature(register).parameters else ())
                    handle = register(state._modules, pre, post, state._modules_to_run_forward, *extra)
                    state._pre_forward_hook_handle = state._post_forward_hook_handle = handle
                self._fsdp_mod_to_saved_methods[module] = _SavedFSDPMethods(group.pre_backward, group.post_backward)
                group.pre_backward = self._fsdp_param_group_pre_backward(module, group.pre_backward)
                group.post_backward = self._fsdp_param_group_post_backward(module, group.post_backward)
            for buffer in self._root_mod.buffers():
                self._update_and_maybe_create_winfos(buffer, _FSDPRefType.BUFFER)

        def _fsdp_param_group_post_backward(self, fsdp_mod, orig_post_backward):
            """FSDPMemTracker._fsdp_param_group_post_backward (torch 2.13), the unsharded
            gradients labelled in a call of their own so that no frame holds one while
            post_backward runs; the snapshots and the sharded gradients as torch's. Another
            torch's tracker, without the names it uses, keeps its own."""
            if not all(hasattr(fmt, n) for n in ("_FSDPModState", "_FSDPState")) or \
                    not hasattr(self, "memory_tracking"):
                return super()._fsdp_param_group_post_backward(fsdp_mod, orig_post_backward)

            def label(kind, grads_of, **kw) -> None:
                group = fsdp_mod._get_fsdp_state()._fsdp_param_group
                for fsdp_param in (group.fsdp_params if group else ()):
                    if (g := grads_of(fsdp_param)) is not None:
                        self._update_and_maybe_create_winfos(g, kind, **kw)

            @wraps(orig_post_backward)
            def inner(*args, **kwargs) -> None:
                label(_FSDPRefType.UNSHARDED_GRAD, lambda p: p._unsharded_param.grad, update_existing=True)
                snaps = self.memory_tracking[fsdp_mod].snapshots
                snaps.setdefault(fmt._FSDPModState.BEF_POST_BW, []).append(self.get_tracker_snapshot())
                self._fsdp_state = fmt._FSDPState.POST_BW
                orig_post_backward(*args, **kwargs)
                label(_FSDPRefType.SHARDED_GRAD, lambda p: p.sharded_param.grad)
                snaps.setdefault(fmt._FSDPModState.AFT_POST_BW, []).append(self.get_tracker_snapshot())

            return inner

    return TraceTracker
