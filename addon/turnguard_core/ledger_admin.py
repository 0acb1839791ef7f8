"""The ledger's inspection queries and operators' control actions, kept out of the hot path.

``LedgerAdmin`` is the ledger (``ledger.Ledger``) plus what ``scripts/turnguard`` (status, list,
show, stats, audit, circuit clear, session release) and turnguard's mitmproxy commands need:
read-only queries, and the audited control actions, which write through the same fenced
transactions as the addon (clearing a circuit never gives an operation a second recovery
dispatch in once mode: ``policy.admit`` counts recoveries on the operation).
"""

from __future__ import annotations

import json
import sqlite3

from . import circuit, liveness, policy
from .ledger import Ledger, LedgerError, _dicts, _wrap
from .records import record

# how long a count apart (``counts_apart``) waits for a lock, or runs on PostgreSQL, at most
COUNT_BOUND_MS = 30_000


@record
class CircuitRow:
    scope: str
    state: circuit.CircuitState
    updated_at: float


@record
class SessionRow:
    session: str
    ownership: policy.SessionOwnership
    updated_at: float


def _circuit_json(state: circuit.CircuitState, now: float) -> str:
    return json.dumps({
        "failures": state.failures, "open_until": state.open_until,
        "cooldown_s": state.cooldown_s, "remaining_s": round(state.remaining_s(now), 3),
    })


def _session_dict(row: policy.SessionOwnership) -> dict:
    return {"owner_instance": row.owner_instance, "owner_epoch": row.owner_epoch,
            "lease_until": row.lease_until}


def _one_by_prefix(rows: list[tuple], prefix: str, *, missing: str, ambiguous: str) -> tuple:
    """The row whose key (first column) is ``prefix``, else the one it starts; raises
    ``LedgerError`` (``missing`` or ``ambiguous``) when there is none or more than one
    (``rows``: at most two, by key). An empty prefix names nothing (it would start every
    key: an operator's slip must not act on whatever row is alone)."""
    if not prefix.strip():
        raise LedgerError("an empty scope or session names nothing")
    exact = [r for r in rows if r[0] == prefix]
    rows = exact or rows
    if not rows:
        raise LedgerError(missing)
    if len(rows) > 1:
        raise LedgerError(ambiguous)
    return rows[0]


class LedgerAdmin(Ledger):
    @_wrap
    def clear_circuits(
        self, scope: str | None, *, now: float, actor: str
    ) -> list[CircuitRow]:
        """Close retry circuits by hand (``scope``: a whole scope or a unique prefix of one;
        None: every circuit that counts failures or cools down). Each is audited with its state
        before. Returns the circuits as they were; raises ``LedgerError`` for an unknown or
        ambiguous scope.

        Clearing changes what the circuit fences and nothing else: its cooldown ends now
        (``open_until`` is set to now, not removed: that it opened after an operation's last
        attempt stays known, so in once mode that operation's next dispatch, through any
        process, is its one recovery, ``policy.admit``), and an operation's recovery
        dispatches are counted on the operation (``recovery_dispatches``), so a cleared
        circuit never yields a second one."""
        with self._tx() as db:
            if scope is None:
                rows = db.execute(
                    "SELECT scope, failures, open_until, cooldown_s, updated_at FROM circuits"
                    " WHERE failures>0 OR open_until>?", (now,),
                ).fetchall()
            else:
                rows = [_one_by_prefix(db.execute(
                    "SELECT scope, failures, open_until, cooldown_s, updated_at FROM circuits"
                    " WHERE scope >= ? AND scope < ? ORDER BY scope LIMIT 2",
                    (scope, scope + "\uffff"),
                ).fetchall(), scope, missing=f"no circuit whose scope starts with {scope!r}",
                    ambiguous=f"circuit scope {scope!r} is ambiguous; give more of it")]
            cleared = [CircuitRow(r[0], circuit.CircuitState(*r[1:4]), r[4]) for r in rows]
            for row in cleared:
                db.execute(
                    "UPDATE circuits SET failures=0, open_until=MIN(open_until, ?),"
                    " cooldown_s=NULL, updated_at=? WHERE scope=?", (now, now, row.scope),
                )
                self._audit(db, now, "circuit_clear", row.scope, actor,
                            _circuit_json(row.state, now), _circuit_json(circuit.CircuitState(), now))
            return cleared

    @_wrap
    def release_session(
        self, session: str, *, now: float, actor: str
    ) -> tuple[str, policy.SessionOwnership, policy.SessionOwnership]:
        """Release a durable session's ownership by hand (``session``: the session or a unique
        prefix): no process owns it afterwards and its epoch moves on, so every write fenced
        with the old epoch fails (a request held through a cooldown by the old owner fails
        closed) and the next process to serve the session takes it over with a higher epoch
        (``policy.release_session``). Audited. Returns the session and its row before and
        after."""
        with self._tx() as db:
            key = _one_by_prefix(db.execute(
                "SELECT session FROM sessions WHERE session >= ? AND session < ?"
                " ORDER BY session LIMIT 2", (session, session + "\uffff"),
            ).fetchall(), session,
                missing=f"no durable session whose id starts with {session!r}",
                ambiguous=f"session {session!r} is ambiguous; give more of it")[0]
            before = self._session(db, key)
            after = policy.release_session(before, now=now)
            db.execute(
                "UPDATE sessions SET owner_instance=?, owner_epoch=?, lease_until=?,"
                " updated_at=? WHERE session=? AND owner_epoch=?",
                (after.owner_instance, after.owner_epoch, after.lease_until, now, key,
                 before.owner_epoch),
            )
            self._audit(db, now, "session_release", key, actor,
                        json.dumps(_session_dict(before)), json.dumps(_session_dict(after)))
            return key, before, after

    @staticmethod
    def _audit(db: sqlite3.Connection, now: float, action: str, target: str, actor: str,
               before: str | None, after: str | None) -> None:
        db.execute(
            "INSERT INTO control_audit (at, action, target, actor, before, after)"
            " VALUES (?,?,?,?,?,?)", (now, action, target, actor, before, after),
        )

    # -- inspection ----------------------------------------------------------------------------
    @_wrap
    def counts(self) -> dict[str, int]:
        rows = self._conn().execute("SELECT state, COUNT(*) FROM operations GROUP BY state")
        return {state: n for state, n in rows}

    def counts_apart(self) -> dict[str, int]:
        """``counts`` on a read-only connection of its own (``open_readonly``), opened and
        closed here, from any thread: the scan of the whole table (about 280 ms for a million
        operations) never holds this connection, the one the addon's calls run on in order.
        Raises ``LedgerError``."""
        other = LedgerAdmin(self.path, self.instance_id, busy_timeout_ms=COUNT_BOUND_MS,
                            identity=self.identity)
        other.open_readonly()
        try:
            counted = other.counts()
            if not other.read_was_stable():
                raise LedgerError("the ledger changed while it was counted")
            return counted
        finally:
            other.close()

    @_wrap
    def list_operations(self, limit: int = 50) -> list[dict]:
        cur = self._conn().execute(
            "SELECT op_key, state, method, path, session, attempts, created_at, updated_at,"
            " replay_attempt IS NOT NULL AS replayable FROM operations"
            " ORDER BY updated_at DESC LIMIT ?",
            (limit,),
        )
        return _dicts(cur)

    @_wrap
    def find_operation(self, op_prefix: str) -> dict | None:
        """One operation whose key starts with ``op_prefix``, with its attempts."""
        db = self._conn()
        cur = db.execute(
            "SELECT * FROM operations WHERE op_key >= ? AND op_key < ? ORDER BY op_key LIMIT 2",
            (op_prefix, op_prefix + "\uffff"),
        )
        ops = _dicts(cur)
        if len(ops) != 1:
            return None if not ops else {"ambiguous": [o["op_key"] for o in ops]}
        op = ops[0]
        cur = db.execute(
            "SELECT a.*, (SELECT COUNT(*) FROM spool s WHERE s.attempt_id=a.attempt_id)"
            " AS spool_chunks FROM attempts a WHERE op_key=? ORDER BY attempt_id",
            (op["op_key"],),
        )
        op["attempt_rows"] = _dicts(cur)
        return op

    @_wrap
    def duplicate_totals(self) -> dict[str, int]:
        """Duplicates held and replayed, over the operations the ledger still keeps."""
        held, replayed = self._conn().execute(
            "SELECT COALESCE(SUM(duplicates_held), 0), COALESCE(SUM(duplicates_replayed), 0)"
            " FROM operations"
        ).fetchone()
        return {"held": held, "replayed": replayed}

    @_wrap
    def circuits(self, now: float) -> list[CircuitRow]:
        """Every circuit that counts failures or cools down now, most recently changed first."""
        rows = self._conn().execute(
            "SELECT scope, failures, open_until, cooldown_s, updated_at FROM circuits"
            " WHERE failures>0 OR open_until>? ORDER BY updated_at DESC",
            (now,),
        ).fetchall()
        return [CircuitRow(r[0], circuit.CircuitState(*r[1:4]), r[4]) for r in rows]

    @_wrap
    def sessions(self, limit: int = 100) -> list[SessionRow]:
        """Durable sessions, most recently changed first."""
        rows = self._conn().execute(
            "SELECT session, durable_id, owner_instance, owner_epoch, lease_until, updated_at"
            " FROM sessions ORDER BY updated_at DESC LIMIT ?",
            (limit,),
        ).fetchall()
        return [SessionRow(r[0], policy.SessionOwnership(*r[1:5]), r[5]) for r in rows]

    @_wrap
    def instances(self) -> list[liveness.PeerRow]:
        """Every registered process, most recent heartbeat first."""
        rows = self._conn().execute(
            "SELECT instance_id, host, boot_id, pid_ns, pid, start_ticks, heartbeat_at"
            " FROM instances ORDER BY heartbeat_at DESC"
        ).fetchall()
        return [liveness.PeerRow(r[0], liveness.ProcessIdentity(*r[1:6]), r[6]) for r in rows]

    @_wrap
    def audit_log(self, limit: int = 50) -> list[dict]:
        """The latest control actions, newest first."""
        cur = self._conn().execute(
            "SELECT audit_id, at, action, target, actor, before, after FROM control_audit"
            " ORDER BY audit_id DESC LIMIT ?",
            (limit,),
        )
        return _dicts(cur)

    @_wrap
    def integrity_check(self) -> str:
        return self._conn().execute("PRAGMA integrity_check").fetchone()[0]
