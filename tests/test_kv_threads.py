"""Two things that made outputs wrong or slow once requests came from more than one place.

1. llama.cpp's sliding-window cache (Gemma 3's) gives a cell that only one sequence holds,
   outside that sequence's window, to another token when it needs room, and the sequence loses
   its positions up to that one there. A slot cut back to an earlier position then attends to
   a window with a hole (its first tokens gone from those layers): the engine decodes such a
   prompt again instead (`Backend.continuable`), and a branch id whose main sequence lost its
   first cells is copied afresh (llama.cpp refuses a batch coupling sequences whose first
   positions differ).
2. A thread done decoding lets its OpenMP pool go (`srsd_local/llama/omp.py`), so the thread
   that decodes next is the only one with a pool (libgomp throttles spinning otherwise).
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

from srsd_local.bench.workloads import load_workload
from srsd_local.engine import Engine
from srsd_local.llama import omp
from srsd_local.llama.backend import Backend


class _Memory:
    """A fake of the llama.cpp calls `continuable` and `seq_fork` make: first positions per
    sequence, and a log of removals and copies."""

    def __init__(self, lows: dict[int, int]) -> None:
        self.lows = lows
        self.highs: dict[int, int] = {}
        self.calls: list[tuple] = []

    def llama_memory_seq_pos_min(self, mem, seq):
        return self.lows.get(seq, -1)

    def llama_memory_seq_rm(self, mem, seq, p0, p1):
        self.calls.append(("rm", seq, p0, p1))
        return True

    def llama_memory_seq_cp(self, mem, src, dst, p0, p1):
        self.calls.append(("cp", src, dst, p0, p1))

    def llama_memory_seq_pos_max(self, mem, seq):
        return self.highs.get(seq, -1)


def _fake_backend(lows: dict[int, int], n_swa: int = 512) -> SimpleNamespace:
    be = SimpleNamespace(_L=_Memory(lows), mem=None, n_swa=n_swa, _shares={}, _lows={},
                         config=SimpleNamespace(max_branches=8),
                         _UNBOUNDED=Backend._UNBOUNDED, _branch_ids=Backend._branch_ids,
                         _check_rm=Backend._check_rm)
    be.seq_fork = lambda *a: Backend.seq_fork(be, *a)
    be._drop_tree = lambda *a: Backend._drop_tree(be, *a)
    return be


def test_continuable_only_where_the_window_is_whole():
    be = _fake_backend({0: 0, 1: 76, 2: -1})
    cont = Backend.continuable
    assert cont(be, 0, 40) == 40  # nothing lost
    assert cont(be, 2, 40) == 40  # (an empty sequence)
    assert cont(be, 1, 40) == 0  # positions 0..75 gone: the window at 40 needs them
    assert cont(be, 1, 587) == 587  # the window at 587 starts at 76
    assert cont(be, 1, 586) == 0  # ... at 586, at 75
    assert cont(be, 1, 0) == 0
    assert cont(_fake_backend({1: 5}, n_swa=0), 1, 900) == 0  # no window: a hole is a hole


def test_fork_copies_a_branch_afresh_after_its_main_lost_first_cells():
    be = _fake_backend({0: 0})
    Backend.seq_fork(be, 0, 3)  # branch ids 1 and 2 get everything
    assert be._L.calls == [("cp", 0, 1, 0, -1), ("cp", 0, 2, 0, -1)]
    be._shares[1] = be._shares[2] = (0, 300)  # after a commit at 300: they hold < 300
    be._L.calls.clear()
    Backend.seq_fork(be, 0, 3)  # only what the main sequence got since
    assert be._L.calls == [("cp", 0, 1, 300, -1), ("cp", 0, 2, 300, -1)]
    be._shares[1] = be._shares[2] = (0, 400)
    be._L.lows[0] = 12  # llama.cpp took the main sequence's first cells
    be._L.calls.clear()
    Backend.seq_fork(be, 0, 2)  # branch 1 is copied afresh
    assert be._L.calls == [("rm", 1, -1, -1), ("cp", 0, 1, 0, -1)]
    be._L.calls.clear()
    Backend.seq_fork(be, 0, 3)  # branch 2 too, when it is used; branch 1 is in step now
    assert be._L.calls == [("cp", 0, 1, 1 << 30, -1), ("rm", 2, -1, -1), ("cp", 0, 2, 0, -1)]


def test_a_tree_with_branch_0_on_the_main_sequence_copies_only_into_the_other_ids():
    """`with_base`: branch 0 of a tree is the main sequence itself, branches 1.. the ids from
    `first` on (a greedy request sampled in the graph); the prompt's cells shared with those
    ids once (`seq_share`), so a tree's fork copies only what the main sequence got since,
    and a commit drops the tree from the ids it used."""
    assert Backend.branch_seqs(0, 3, 20, True) == [0, 20, 21]
    assert list(Backend._branch_ids(0, 3, 20, True)) == [20, 21]
    assert Backend.branch_seqs(0, 3, 20) == [20, 21, 22]  # (a drawn tree: all on the ids)
    assert Backend.branch_seqs(0, 3, 0, True) == Backend.branch_seqs(0, 3, None) == [0, 1, 2]
    be = _fake_backend({0: 0})
    be._L.highs[0] = 499  # the prompt: positions 0..499
    Backend.seq_share(be, 0, 9, 20, True)  # ids 20..27 get them
    assert be._L.calls == [("cp", 0, s, 0, -1) for s in range(20, 28)]
    assert all(be._shares[s] == (0, 500) for s in range(20, 28))
    be._L.calls.clear()
    Backend.seq_fork(be, 0, 3, 20, True)  # a 3-branch tree at 530: two ids, 30 new cells
    assert be._L.calls == [("cp", 0, 20, 500, -1), ("cp", 0, 21, 500, -1)]
    be._L.calls.clear()
    Backend.seq_commit(be, 0, 21, 530, 533, 3, 20, True)  # branch 2 won, 3 cells kept
    assert be._L.calls == [("rm", 0, 530, -1), ("cp", 21, 0, 530, 533), ("rm", 20, 530, -1),
                           ("rm", 21, 530, -1)]
    assert be._shares[20] == be._shares[21] == (0, 530) and be._shares[22] == (0, 500)
    be._L.calls.clear()
    Backend.seq_fork(be, 0, 2, 20, True)
    Backend.seq_commit(be, 0, 0, 540, 542, 2, 20, True)  # branch 0 (the main one) won
    assert be._L.calls == [("cp", 0, 20, 530, -1), ("rm", 20, 540, -1), ("rm", 0, 542, -1)]
    with pytest.raises(ValueError, match="branches"):
        Backend.seq_fork(be, 0, 10, 20, True)  # 9 ids: one more than there are


@pytest.fixture(scope="module")
def two(model_path):
    eng = Engine.load(model_path, n_ctx=1024, parallel=2, learned=False)
    yield eng
    eng.close()


@pytest.mark.model
def test_a_prompt_whose_window_lost_cells_is_decoded_again(two):
    """The slot's early cells taken by other tokens (llama.cpp's sliding-window cache reuses
    cells outside a sequence's window before empty ones further on): a prompt sharing only
    its first 40 tokens with the slot is decoded from scratch, and its output is plain
    decoding's at every position."""
    be = two.backend
    text = " ".join(p.prompt for p in load_workload("code_edit")[:6])
    toks = two.tokenize(text)
    assert len(toks) > 1400
    two.reset()
    spare = two.slots[1].base + 3  # a branch id an `ar` request never uses
    # cells 0..99: another sequence's; then the slot's prompt of 700 tokens after them
    be.decode(toks[1000:1100], positions=list(range(100)), seq_ids=[[spare]] * 100,
              want_logits="none")
    first = toks[:700]
    two.generate(first, max_tokens=1, mode="ar")
    slot = max(two.slots, key=lambda s: s.last_used)
    be.seq_trim(spare, 0)  # cells 0..99 free again: the caches look for room from there
    # 300 more tokens: the sliding-window cache takes cells 0..99, then the slot's own
    # cells of positions 0..188 (outside the window of position 700) before the empty ones
    # (sampled with a top-k: the last prompt chunk of a request sampled in llama.cpp's
    # graph, greedy or at a temperature alone, also goes on a branch id, which would hold
    # those cells too, and a cell two sequences hold is not taken)
    two.generate(first + toks[700:1000], max_tokens=1, mode="ar", temperature=0.7, top_k=40,
                 seed=1)
    assert max(two.slots, key=lambda s: s.last_used) is slot
    assert be._L.llama_memory_seq_pos_min(be.mem, slot.base) > 0  # its window lost them
    prompt = first[:40] + toks[1200:1400]  # shares 40 tokens with the slot
    out = two.generate(prompt, max_tokens=24, mode="srsd")
    assert max(two.slots, key=lambda s: s.last_used) is slot
    assert out.stats.reused_prompt_tokens == 0
    report = two.verify_output(prompt, out.token_ids)
    assert report.positions == len(out.token_ids) > 0
    assert report.ok, report.summary()


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settles_at(count: int) -> bool:
    deadline = time.time() + 5
    while time.time() < deadline:
        if _threads() == count:
            return True
        time.sleep(0.02)
    return False


@pytest.mark.model
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_thread_done_decoding_keeps_no_openmp_pool(two):
    be = two.backend
    assert be.cpu_openmp and be.config.threads > 1  # (the pinned build on a multi-core CPU)
    assert omp.release()  # libgomp is loaded: this thread's pool, if any, goes
    assert _settles_at(_threads())
    base = _threads()
    it = two.stream("def add(a, b):", max_tokens=12, mode="ar")
    next(it)  # the prompt was decoded on this thread: its pool is there now
    during = _threads()
    list(it)
    assert during > base
    assert _settles_at(base)  # let go when the generation ended
    # the scheduler thread decodes from now on: it and its pool are the only ones added
    pool = during - base
    list(two.submit("def sub(a, b):", max_tokens=8, mode="ar"))
    assert _settles_at(base + 1 + pool)
