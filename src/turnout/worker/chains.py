"""Chained pipeline stages on the worker: start the next stage the moment this one succeeds, before its task exists.

A stage's lease may list the stages after it that the controller lets run right after it here (`chain`, see
runs.py). When the stage succeeds, the agent starts the next one at once under an id it makes, and the stage's
result names that id (`chain`). Until the controller answers that result, the new stage is *unconfirmed*: it
runs, but nothing of it may reach the controller on its own (its task does not exist yet), and the lease
requests do not list it (the controller would stop a task it does not know). The answer confirms the chain
(the task now exists, leased here) or refuses it (the stage is queued as usual), and the agent then stops what
it started, with every stage it chained in turn.

A result of an unconfirmed stage may go in the same report as its parent's result, right after it (the
controller settles them in order), but only when the stage has no events waiting: those can be stored only once
its task exists. Where the parent's result would go alone, it waits `CHAIN_HOLD_S` for the stage started after
it, so a run of short stages costs one report, not one per stage.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from turnout.models import new_id
from turnout.pipelines import stage_input

CHAIN_HOLD_S = 0.02  # how long a result waits for the stage chained after it, to travel in one report


@dataclass
class ChainBook:
    """Which stages started here wait for the controller to confirm them, and which were refused."""

    parent_of: dict[str, str] = field(default_factory=dict)  # unconfirmed stage -> the stage it followed
    child_of: dict[str, str] = field(
        default_factory=dict
    )  # stage whose result is unanswered -> its chained one
    dropped: set[str] = field(default_factory=set)  # refused stages: whatever they left queued is not sent

    def start(self, parent: str, child: str) -> None:
        self.parent_of[child] = parent
        self.child_of[parent] = child

    def unconfirmed(self, task_id: str) -> bool:
        return task_id in self.parent_of

    def settle(self, answer: Mapping[str, Any]) -> tuple[list[str], list[str]]:
        """A report's answer: (confirmed, refused) stages, a refused one followed by all it chained in turn.

        A stage's chain stands only where the answer lists it in `chained`; any other answer to its parent's
        result (refused, a controller that knows no chains) refuses it."""
        chained = set(_ids(answer.get("chained")))
        confirmed: list[str] = []
        refused: list[str] = []
        for parent in [*_ids(answer.get("accepted")), *_ids(answer.get("refused"))]:
            child = self.child_of.pop(parent, None)
            if child is None:
                continue
            if child in chained:
                self.parent_of.pop(child, None)
                confirmed.append(child)
            else:
                refused += self._drop(child)
        return confirmed, refused

    def _drop(self, task_id: str) -> list[str]:
        out = []
        current: str | None = task_id
        while current is not None:
            self.parent_of.pop(current, None)
            self.dropped.add(current)
            out.append(current)
            current = self.child_of.pop(current, None)
        return out

    def sendable(
        self, completions: Sequence[dict[str, Any]], events: Sequence[dict[str, Any]]
    ) -> tuple[list[int], list[int]]:
        """The positions of the completions and events that may be sent now, in order (see the module docstring)."""
        waiting = {e.get("task_id") for e in events if self.unconfirmed(str(e.get("task_id")))}
        going: set[str] = set()
        results = []
        for i, c in enumerate(completions):
            task_id = str(c.get("task_id"))
            parent = self.parent_of.get(task_id)
            if parent is None or (parent in going and task_id not in waiting):
                going.add(task_id)
                results.append(i)
        sent_events = [i for i, e in enumerate(events) if not self.unconfirmed(str(e.get("task_id")))]
        return results, sent_events

    def forget_dropped(self, still_here: Iterable[str]) -> None:
        """Keep only the refused stages that still run here or have reports queued."""
        self.dropped &= set(still_here)


def chained_lease(
    lease: Mapping[str, Any], output: Any, cpu_resources: dict[str, Any]
) -> dict[str, Any] | None:
    """The lease of the stage to start after `lease` succeeded with `output`, as the controller would make it
    (runs.py `_stage_task`): its input is this stage's input updated with this stage's output, read back from
    JSON as the controller will store it. None when the lease names no next stage."""
    steps = lease.get("chain") or []
    if not steps or not isinstance(lease.get("input"), Mapping):
        return None
    step = steps[0]
    stored = json.loads(json.dumps(output, allow_nan=False))
    return {
        "id": new_id("t_"), "attempt": 1, "capability": step["capability"], "device": "cpu",
        "input": stage_input(lease["input"], [(str(lease.get("capability")), stored)]),
        "resources": cpu_resources, "gpus": None, "timeout_s": step.get("timeout_s"),
        "labels": step.get("labels") or {}, "tenant": lease.get("tenant"), "routing": None, "batch": None,
        "chain": steps[1:],
    }  # fmt: skip


def reorder(items: list[dict[str, Any]], first: Sequence[int], drop: set[str]) -> int:
    """Put the items at positions `first` at the front (order kept, then the rest in order), leaving out those
    of dropped stages; returns how many are at the front. In place: the senders share these lists."""
    chosen = set(first)
    front = [it for i, it in enumerate(items) if i in chosen and it.get("task_id") not in drop]
    rest = [it for i, it in enumerate(items) if i not in chosen and it.get("task_id") not in drop]
    items[:] = front + rest
    return len(front)


def _ids(value: Any) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []
