"""Eval stops on every process together when one process's eval share runs out first."""

from __future__ import annotations

from maxtext.train import loop


def test_eval_batches_stops_when_any_process_is_out(monkeypatch):
  other_process_batches = 2  # the other host's share packed into 2 batches, this host's into 4
  calls = []

  def agree(flag: bool) -> bool:
    calls.append(flag)
    return flag and len(calls) <= other_process_batches

  monkeypatch.setattr(loop, "all_processes_agree", agree)
  assert list(loop.eval_batches(iter("abcd"), limit=-1)) == ["a", "b"]


def test_eval_batches_respects_the_limit_and_the_end_of_data():
  assert list(loop.eval_batches(iter("abcd"), limit=3)) == ["a", "b", "c"]
  assert list(loop.eval_batches(iter("ab"), limit=-1)) == ["a", "b"]
  assert loop.all_processes_agree(True) and not loop.all_processes_agree(False)
