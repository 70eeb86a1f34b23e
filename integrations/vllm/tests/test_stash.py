"""The stash of lean plain steps (`dmtp_vllm.stash`): rows grouped per request for one causal catch-up query each,
requests not in the batch kept while vLLM holds them, positions processed again taken from their later pass."""

from __future__ import annotations

import torch

from dmtp_vllm.stash import DraftStateStash

HIDDEN = 3


def add_step(stash: DraftStateStash, rows: list[tuple[str, list[int]]]) -> None:
    """One plain step: ``(request, positions)`` per request in batch order; every tensor encodes (request, position)
    so that a test reads back which row went where."""
    requests = [r for r, _ in rows]
    lengths = torch.tensor([len(p) for _, p in rows])
    positions = torch.tensor([p for _, ps in rows for p in ps])
    tags = torch.tensor([1000 * (ord(r[-1]) - ord("a")) + p for r, ps in rows for p in ps])
    hidden = tags[:, None].float().expand(-1, HIDDEN)
    stash.add(requests, lengths, positions, tags + 7, tags, hidden, torch.cat([hidden, hidden], 1))


def test_rows_are_grouped_per_request_in_batch_order():
    """Rows of three steps (a prompt among them) come back per request, in the batch's order, step order within."""
    stash = DraftStateStash(budget=64)
    add_step(stash, [("req-a", [5]), ("req-b", [0, 1, 2])])  # b's prompt arrives while a decodes
    add_step(stash, [("req-a", [6]), ("req-b", [3])])
    add_step(stash, [("req-b", [4]), ("req-a", [7])])  # the batch's order changes
    assert stash.rows == 8 and not stash.fits(57)
    catch = stash.take(["req-b", "req-a"])
    assert catch.batch_rows.tolist() == [0, 1]
    assert catch.query_lengths.tolist() == [5, 3]
    assert catch.seq_lengths.tolist() == [5, 8]  # each causal query ends at its last stashed position
    assert catch.rows.positions.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert catch.rows.pair_tokens.tolist() == [1000, 1001, 1002, 1003, 1004, 5, 6, 7]
    assert catch.rows.slots.tolist() == [t + 7 for t in catch.rows.pair_tokens.tolist()]
    assert catch.rows.hidden[:, 0].tolist() == catch.rows.pair_tokens.float().tolist()
    assert catch.rows.context.shape == (8, 2 * HIDDEN)
    assert stash.rows == 0 and not stash.handles and stash.take(["req-a"]) is None


def test_requests_outside_the_batch_wait_while_alive():
    """A request vLLM still holds keeps its rows until it is in a batch again; a finished one's are dropped."""
    stash = DraftStateStash(budget=64)
    add_step(stash, [("req-a", [5]), ("req-b", [9]), ("req-c", [2])])
    add_step(stash, [("req-a", [6]), ("req-b", [10])])
    catch = stash.take(["req-a"], alive={"req-a", "req-b"})  # b not scheduled this step, c finished
    assert catch.rows.positions.tolist() == [5, 6]
    assert stash.rows == 2  # b's rows wait for b
    add_step(stash, [("req-b", [11])])
    catch = stash.take(["req-b"], alive={"req-b"})
    assert catch.rows.positions.tolist() == [9, 10, 11] and catch.seq_lengths.tolist() == [12]
    assert stash.rows == 0


def test_positions_processed_again_come_from_the_later_pass():
    """A preempted request is recomputed from an earlier position: its earlier rows there are stale."""
    stash = DraftStateStash(budget=64)
    add_step(stash, [("req-a", [4]), ("req-b", [7])])
    add_step(stash, [("req-a", [5])])
    add_step(stash, [("req-a", [2, 3, 4, 5]), ("req-b", [8])])  # a recomputed from position 2
    add_step(stash, [("req-a", [6])])
    catch = stash.take(["req-a", "req-b"])
    assert catch.query_lengths.tolist() == [5, 2]
    assert catch.rows.positions.tolist() == [2, 3, 4, 5, 6, 7, 8]
    assert catch.seq_lengths.tolist() == [7, 9]
