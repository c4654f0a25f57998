"""Prefix-aware admission: a sequence whose image another sequence is still prefilling waits for that KV.

The first sequence to bring an image (its leader) computes the image's KV blocks; a later one with the same
image is held back until the leader's computed tokens pass the image, then joins the waiting queue and takes
those blocks from the prefix cache instead of recomputing them. A leader that is preempted or finishes stops
leading, and its followers are released.
"""
from __future__ import annotations

from .sequence import Sequence, SequenceStatus

_LEADING = (SequenceStatus.WAITING, SequenceStatus.RUNNING)


class SharedImageAdmission:
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled  # off without the prefix cache: there is no KV to share
        self.held: list[Sequence] = []  # added, waiting for a leader to compute their shared image
        self.leaders: dict[str, Sequence] = {}  # image key -> the sequence that computes its KV first
        self.num_deferred = 0  # sequences ever held back

    def admit(self, seq: Sequence, *, first: bool = True) -> bool:
        """True: `seq` may join the waiting queue now (it leads the images nobody leads yet); False: it is held."""
        if self.enabled and self._follows(seq):
            self.held.append(seq)
            self.num_deferred += first
            return False
        for img in seq.images:
            self.leaders.setdefault(img.content_hash, seq)
        return True

    def release(self) -> list[Sequence]:
        """The held sequences that may join now, in arrival order; one released first may lead the next."""
        held, self.held = self.held, []
        return [seq for seq in held if self.admit(seq, first=False)]

    def forget(self, seq: Sequence) -> bool:
        """`seq` finished or was aborted: it is neither held nor leading. Returns whether it was held."""
        for img in seq.images:
            if self.leaders.get(img.content_hash) is seq:
                del self.leaders[img.content_hash]
        if seq in self.held:
            self.held.remove(seq)
            return True
        return False

    def _follows(self, seq: Sequence) -> bool:
        # True while another sequence still has to compute the KV of one of seq's images
        for img in seq.images:
            leader = self.leaders.get(img.content_hash)
            if leader is None:
                continue
            if leader.status not in _LEADING:  # preempted (its KV is gone) or finished
                del self.leaders[img.content_hash]
            elif leader.num_computed_tokens < img.end:
                return True
        return False
