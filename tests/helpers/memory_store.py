"""The part of torch's ``Store`` that the watchdog and the first-error report use, in
memory: the unit tests drive them without a launcher."""

from __future__ import annotations


class MemoryStore:
    """``set`` / ``get`` / ``check`` / ``multi_get`` / ``multi_set`` / ``add`` on a dict of
    bytes, as ``torch.distributed.Store`` answers them."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        return self.data[key]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.data[k] for k in keys]

    def multi_set(self, keys: list[str], values: list) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)

    def add(self, key: str, amount: int) -> int:
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value
