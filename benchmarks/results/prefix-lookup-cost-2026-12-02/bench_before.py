import statistics, time, sys
from pathlib import Path
sys.path.insert(0, "/tmp/s27before")
from router.prefix import ChatPrompt
from router.prefix.hashing import DEFAULT_SEED, chain_keys
import router.prefix
assert router.prefix.__file__.startswith("/tmp/s27before"), router.prefix.__file__
_RULE = "Rule 7: keep the tool output short and cite the file. "
def _body(chars, turn=0, tenant=0):
    system = (f"You work for tenant {tenant}. " + _RULE * (chars // len(_RULE) + 1))[:chars]
    return {"model": "tiny", "messages": [{"role": "system", "content": system},
            {"role": "user", "content": f"Where is the config parsed? (question {turn})"}]}
p = ChatPrompt.from_model_dir(Path("/work/main/.gpupool/models/tiny"))
for chars in (2000, 8000, 32000):
    p.token_ids(_body(chars, -1))
    for name, f in (("never seen", lambda r: _body(chars, r, 1 + r)), ("seen prefix + new user turn", lambda r: _body(chars, r))):
        a = []; b = []
        for r in range(15):
            t0 = time.perf_counter(); ids = p.token_ids(f(r)); t1 = time.perf_counter(); chain_keys(ids, 128, DEFAULT_SEED); a.append(t1 - t0); b.append(time.perf_counter() - t1)
        print(f"BEFORE {chars} chars, {len(ids)} tokens, {name}: token ids {statistics.median(a)*1e3:.2f} ms, chain {statistics.median(b)*1e3:.2f} ms")
