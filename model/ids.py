"""External id <-> internal index vocabularies.

External `user_id` / `item_id` strings come from data files and requests; internal `user_idx` /
`item_idx` index the embedding tables and the rating matrix. Conversion happens only here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


class UnknownIdError(KeyError):
    """Some external ids are not in the vocabulary; `missing` lists them in request order."""

    def __init__(self, kind: str, missing: list[str]) -> None:
        self.kind = kind
        self.missing = missing
        shown = ", ".join(repr(m) for m in missing[:20])
        more = f" (and {len(missing) - 20} more)" if len(missing) > 20 else ""
        super().__init__(f"unknown {kind} id(s): {shown}{more}")

    def __str__(self) -> str:
        return str(self.args[0])


class IdMap:
    """An ordered vocabulary: position i holds the external id of index i."""

    def __init__(self, kind: str, ids: Sequence[str]) -> None:
        self.kind = kind
        self.ids: list[str] = [str(x) for x in ids]
        self._index = {x: i for i, x in enumerate(self.ids)}
        if len(self._index) != len(self.ids):
            raise ValueError(f"duplicate {kind} ids in vocabulary")

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, external_id: object) -> bool:
        return external_id in self._index

    def index(self, external_id: str) -> int:
        """Index of one external id; raises UnknownIdError."""
        try:
            return self._index[external_id]
        except KeyError:
            raise UnknownIdError(self.kind, [external_id]) from None

    def indices(self, external_ids: Iterable[str]) -> np.ndarray:
        """Indices of many external ids (int64); raises UnknownIdError listing every unknown one."""
        ext = list(external_ids)
        out = np.fromiter((self._index.get(x, -1) for x in ext), dtype=np.int64, count=len(ext))
        if (out < 0).any():
            missing = list(dict.fromkeys(x for x, i in zip(ext, out, strict=True) if i < 0))
            raise UnknownIdError(self.kind, missing)
        return out

    def external(self, index: int) -> str:
        """External id of an index."""
        return self.ids[index]
