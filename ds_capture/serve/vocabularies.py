"""The trainers' draft vocabularies (``set_vocab_mapping``), per connection and per client host.

In: ``set_vocab_mapping`` bodies (parsed), the connection and host each came from, and the connections' ends. Out:
the draft vocabulary a ``generate`` is answered with, or a 409 naming the fix.

NeMo 0.7.0's client sends no trainer identity (a ``requests.Session`` per URL; headers ``Content-Type`` and
requests' defaults), and the TCP source port changes with every new connection. So a vocabulary is bound to the
connection that set it, and a new connection (a keep-alive close, a retry, a restarted trainer) gets its host's one
live vocabulary; with two different live ones on the host it is refused (409, naming the fix), never given the
other trainer's. With a ``store`` directory each vocabulary is also kept on disk (the ``set_vocab_mapping`` body)
and restored when a restarted service becomes ready, live for ``idle_s``: a trainer riding through a restart
(``launch/slurm.sbatch``'s requeue) keeps its vocabulary.
"""

import hashlib
import logging
import threading
import time
from pathlib import Path
from typing import Callable

from ds_capture.durable import write_atomic
from ds_capture.serve.protocol import BadRequest
from ds_capture.serve.supervision import VocabMapping

VOCAB_SUFFIX = ".vocab"
_LOG = logging.getLogger("ds_capture")


class _Entry:
    __slots__ = ("mapping", "used", "owners", "file")

    def __init__(self, mapping: VocabMapping, used: float, file: Path | None = None) -> None:
        self.mapping, self.used, self.owners, self.file = mapping, used, set(), file

    def forget_file(self) -> None:
        if self.file is not None:
            self.file.unlink(missing_ok=True)
            self.file = None


class VocabMappings:
    """The trainers' draft vocabularies: exact per connection, shared per client host (module docstring).

    A ``set_vocab_mapping`` on a connection binds that connection to the mapping (replacing what the connection
    set before; equal mappings on one host are one entry). A ``generate`` on a bound connection gets its own
    mapping. On a connection that set none (a trainer's keep-alive connection replaced after a blip, a timeout's
    retry, a restart with the same vocabulary), it gets the host's one *live* mapping and is bound to it; with two
    or more live mappings on the host it is refused (409, naming the fix), never given a guess. A mapping is live
    while a connection bound to it is open or a request used it within ``idle_s``; one that is neither is
    forgotten. ``disconnect`` unbinds the connection (its mapping is forgotten when nothing else holds it).
    """

    def __init__(self, idle_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 store: Path | None = None) -> None:
        self.idle_s = idle_s
        self._clock = clock
        self.store = store
        self._hosts: dict[str, list[_Entry]] = {}
        self._bound: dict[object, _Entry] = {}  # connection -> its entry
        self._lock = threading.Lock()

    def _live(self, host: str, now: float) -> list[_Entry]:
        """The host's live entries; the others are forgotten here."""
        entries = self._hosts.get(host, [])
        live = [entry for entry in entries if entry.owners or now - entry.used < self.idle_s]
        for entry in entries:
            if entry not in live:
                entry.forget_file()
        if live:
            self._hosts[host] = live
        else:
            self._hosts.pop(host, None)
        return live

    def _bind(self, connection: object, entry: _Entry) -> None:
        old = self._bound.get(connection)
        if old is not None:
            old.owners.discard(connection)
        if connection is not None:
            entry.owners.add(connection)
            self._bound[connection] = entry

    def set(self, host: str, connection: object, mapping: VocabMapping, raw: bytes | None = None) -> None:
        """Bind ``connection`` to ``mapping`` (``raw``: its request body, kept in ``store`` when there is one)."""
        with self._lock:
            now = self._clock()
            old = self._bound.pop(connection, None)
            if old is not None:
                old.owners.discard(connection)
                if not old.owners:
                    old.used = -float("inf")  # what this connection set before is replaced
            entries = self._live(host, now)
            entry = next((entry for entry in entries if entry.mapping.same_as(mapping)), None)
            if entry is None:
                entry = _Entry(mapping, now, self._keep(host, raw))
                self._hosts.setdefault(host, []).append(entry)
            entry.used = now
            self._bind(connection, entry)

    def get(self, host: str, connection: object) -> VocabMapping:
        with self._lock:
            now = self._clock()
            entry = self._bound.get(connection)
            if entry is not None:
                entry.used = now
                return entry.mapping
            live = self._live(host, now)
            if len(live) == 1:
                live[0].used = now
                self._bind(connection, live[0])
                return live[0].mapping
        if not live:
            raise BadRequest(409, "generate before set_vocab_mapping: the trainer must send its draft vocabulary "
                                  f"first (RemoteEagle3TargetModel.set_vocab_mapping; none live from host {host})",
                             reason="no_vocab_mapping")
        raise BadRequest(409, f"generate on a new connection from host {host}, where {len(live)} different draft "
                              "vocabularies are in use: NeMo's client sends no trainer identity, so this service "
                              "cannot tell whose request this is. Run one service per draft vocabulary, or give "
                              "each trainer on a host its own source address; a vocabulary is forgotten "
                              f"{self.idle_s:g} s after its trainer's last request and connection (--vocab-idle-s)",
                         reason="vocab_mapping_ambiguous")

    def closed(self, connection: object) -> None:
        """The connection ended (its mapping stays live for ``idle_s`` after its last use)."""
        with self._lock:
            entry = self._bound.pop(connection, None)
            if entry is not None:
                entry.owners.discard(connection)

    def disconnect(self, host: str, connection: object) -> None:
        """NeMo's ``disconnect``: the trainer is done with its mapping."""
        with self._lock:
            entry = self._bound.pop(connection, None)
            if entry is None:
                live = self._live(host, self._clock())
                entry = live[0] if len(live) == 1 else None
            if entry is not None:
                entry.owners.discard(connection)
                if not entry.owners:
                    entry.used = -float("inf")
                    entry.forget_file()

    def _keep(self, host: str, raw: bytes | None) -> Path | None:
        """``raw`` written to ``store`` as ``<host>-<digest>.vocab`` (None without a store)."""
        if self.store is None or raw is None:
            return None
        self.store.mkdir(parents=True, exist_ok=True)
        path = self.store / f"{host.replace(':', '_')}-{hashlib.sha256(raw).hexdigest()[:16]}{VOCAB_SUFFIX}"
        write_atomic(path, lambda tmp: tmp.write_bytes(raw))
        return path

    def restore(self, parse: Callable[[bytes], VocabMapping]) -> int:
        """The vocabularies kept in ``store`` by a previous run of this replica, each live for ``idle_s`` from now
        (a file that no longer parses is set aside, with one log line); returns how many."""
        if self.store is None or not self.store.is_dir():
            return 0
        restored = 0
        with self._lock:
            now = self._clock()
            for path in sorted(self.store.glob(f"*{VOCAB_SUFFIX}")):
                host = path.name[: -len(VOCAB_SUFFIX)].rsplit("-", 1)[0]
                try:
                    mapping = parse(path.read_bytes())
                except (BadRequest, OSError) as error:
                    _LOG.warning("ds-capture serve: %s is not a draft vocabulary (%s); set aside as %s.bad", path,
                                 getattr(error, "message", error), path.name)
                    path.replace(path.with_name(path.name + ".bad"))
                    continue
                entries = self._hosts.setdefault(host, [])
                if not any(entry.mapping.same_as(mapping) for entry in entries):
                    entries.append(_Entry(mapping, now, path))
                    restored += 1
        return restored

    def count(self) -> int:
        with self._lock:
            return sum(len(entries) for entries in self._hosts.values())
