"""Temporary s44 probe: per-request phase timestamps (not committed)."""
import atexit, json, os, time
_T: dict = {}
_BUF: list = []
_PATH = f"/tmp/s44-probe-{os.getpid()}.jsonl"
def mark(rid, name):
    _T.setdefault(rid, {})[name] = time.perf_counter_ns()
def done(rid, **kw):
    rec = _T.pop(rid, None)
    if rec is None:
        return
    rec.update(kw)
    _BUF.append(rec)
    if len(_BUF) >= 200:
        flush()
def flush():
    if _BUF:
        with open(_PATH, "a") as f:
            for r in _BUF:
                f.write(json.dumps(r) + "\n")
        _BUF.clear()
atexit.register(flush)
