"""Device slots for adapters: at most `num_slots` resident, least recently used evicted."""

from __future__ import annotations

from collections import OrderedDict


class SlotTable:
    """adapter id -> device slot (0 .. num_slots - 1), kept in LRU order."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # least recently used first

    def slot_of(self, adapter_id: int) -> int | None:
        return self._slot_of.get(adapter_id)

    def assign(self, adapter_ids: list[int]) -> tuple[dict[int, int], list[tuple[int, int]]]:
        """Slots for one step's adapters (distinct ids, at most num_slots of them): returns
        (id -> slot for each, [(id, slot)] of those that must be loaded into their slot now).
        Residents not in the step are evicted, least recently used first."""
        if len(adapter_ids) > self.num_slots:
            raise ValueError(f"{len(adapter_ids)} adapters in one step, but only {self.num_slots} slots")
        want = set(adapter_ids)
        for a in adapter_ids:
            if a in self._slot_of:
                self._slot_of.move_to_end(a)
        load = []
        for a in adapter_ids:
            if a in self._slot_of:
                continue
            used = set(self._slot_of.values())
            free = next((s for s in range(self.num_slots) if s not in used), None)
            if free is None:
                victim = next(v for v in self._slot_of if v not in want)
                free = self._slot_of.pop(victim)
            self._slot_of[a] = free
            load.append((a, free))
        return {a: self._slot_of[a] for a in adapter_ids}, load

    def drop(self, adapter_id: int) -> None:
        self._slot_of.pop(adapter_id, None)
