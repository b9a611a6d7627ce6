"""The simulated worker's P/D roles, driven with both engines' handshakes over real HTTP: vLLM's
kv_transfer_params (prefill first, then decode with what it returned) and SGLang's bootstrap
fields (both at once); held prefill blocks freed by the decoder's pull or by their lease."""

from __future__ import annotations

import asyncio
import random

import openai

from services.worker_sim.pd import PdSettings
from tests.test_worker_sim_support import post, sim_worker, until

PROMPT = "Disaggregated serving moves the prompt's KV from a prefill engine. " * 6
MODEL = "sim-llama-8b"


def nixl_prefill_body(max_tokens: int = 1) -> dict:
    return {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "stream": False,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }


async def test_nixl_prefill_holds_blocks_until_the_decoder_pulls_them():
    # a lease far longer than the test (30 simulated s are 0.15 s of wall time at 200x)
    async with (
        sim_worker(worker_id="p", pd=PdSettings(role="prefill", lease_s=1e4)) as pw,
        sim_worker(worker_id="d", pd=PdSettings(role="decode")) as dw,
    ):
        assert pw.heartbeat().role == "prefill" and dw.heartbeat().role == "decode"
        status, body, _ = await post(pw.url + "/v1/completions", nixl_prefill_body())
        assert status == 200, body
        params = body["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert params["remote_engine_id"] == pw.instance_id
        assert params["remote_port"] == pw.settings.port
        held = pw.engine.held[params["remote_request_id"]]
        assert params["remote_block_ids"] == [held] and held
        free_while_held = pw.engine.num_free_blocks
        c = openai.AsyncOpenAI(base_url=dw.url + "/v1", api_key="x", max_retries=0)
        try:
            stream = await c.completions.create(
                model=MODEL,
                prompt=PROMPT,
                max_tokens=8,
                stream=True,
                extra_body={"kv_transfer_params": params},
            )
            text = "".join([ch.choices[0].text async for ch in stream if ch.choices])
            assert len(text) == 8
            # the decoder computed no prompt: it received the KV, so an identical plain
            # request now hits every full block of the prompt in its cache
            again = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
            n = len(PROMPT.encode())
            assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
        finally:
            await c.close()
        assert not pw.engine.held and pw.pd_prefill.pulled == 1
        assert pw.engine.num_free_blocks == free_while_held + len(held)
        assert dw.pd_recomputed == 0


async def test_lease_frees_prefill_blocks_nobody_pulled_and_a_late_decoder_recomputes():
    async with (
        sim_worker(worker_id="p", pd=PdSettings(role="prefill", lease_s=20.0)) as pw,
        sim_worker(worker_id="d", pd=PdSettings(role="decode")) as dw,
    ):
        status, body, _ = await post(pw.url + "/v1/completions", nixl_prefill_body())
        assert status == 200 and pw.engine.held
        # 20 simulated seconds at 200x: the lease runs out after 0.1 s of wall time
        await until(lambda: _false_when(pw.engine.held), 5.0, "the lease to free the blocks")
        assert pw.pd_prefill.lease_expired == 1
        assert pw.engine.num_free_blocks == pw.engine.config.num_gpu_blocks
        body2 = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
        body2["kv_transfer_params"] = body["kv_transfer_params"]
        status, out, _ = await post(dw.url + "/v1/completions", body2)
        assert status == 200 and out["usage"]["completion_tokens"] == 3
        assert dw.pd_recomputed == 1  # vLLM's kv_load_failure_policy: recompute


async def _false_when(x) -> bool:
    return not x


async def test_sglang_bootstrap_both_requests_at_once_decoder_waits_for_the_prefill():
    async with (
        sim_worker(worker_id="p", pd=PdSettings(role="prefill", lease_s=1e4)) as pw,
        sim_worker(worker_id="d", pd=PdSettings(role="decode")) as dw,
    ):
        room = random.randint(0, 2**63 - 1)
        boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": pw.settings.port}
        messages = [{"role": "user", "content": PROMPT}]
        c_d = openai.AsyncOpenAI(base_url=dw.url + "/v1", api_key="x", max_retries=0)
        c_p = openai.AsyncOpenAI(base_url=pw.url + "/v1", api_key="x", max_retries=0)
        try:
            extra = {**boot, "bootstrap_room": room}

            async def decode() -> str:
                stream = await c_d.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=6, stream=True, extra_body=extra
                )
                return "".join(
                    [ch.choices[0].delta.content or "" async for ch in stream if ch.choices]
                )

            dtask = asyncio.create_task(decode())  # the decoder may come first
            pre = await c_p.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=6, extra_body=extra
            )
            assert pre.usage.completion_tokens == 1  # a prefill engine makes one token
            assert len(await dtask) == 6
        finally:
            await c_d.close()
            await c_p.close()
        assert not pw.engine.held and pw.pd_prefill.pulled == 1


async def test_bootstrap_decoder_answers_503_when_its_prefill_never_comes():
    async with (
        sim_worker(worker_id="p", pd=PdSettings(role="prefill", bootstrap_timeout_s=20.0)) as pw,
        sim_worker(worker_id="d", pd=PdSettings(role="decode")) as dw,
    ):
        body = {
            "model": MODEL,
            "prompt": PROMPT,
            "max_tokens": 3,
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": pw.settings.port,
            "bootstrap_room": 7,
        }
        status, out, _ = await post(dw.url + "/v1/completions", body)
        assert status == 503 and "KV transfer" in out["error"]["message"]
        assert dw.engine.num_free_blocks == dw.engine.config.num_gpu_blocks  # reservation freed


async def test_heartbeat_role_reaches_the_cluster_state():
    from services.core.cluster import ClusterState

    cs = ClusterState()
    async with sim_worker(worker_id="p", pd=PdSettings(role="prefill")) as pw:
        cs.on_heartbeat(pw.heartbeat(), now=0.0)
    assert cs.states["p"].role == "prefill"
    seen: set[str] = set()
    cs.snapshot.watchers.append(seen)
    hb = pw.heartbeat()
    cs.on_heartbeat(
        type(hb)(**{**{f: getattr(hb, f) for f in hb.__struct_fields__}, "role": "decode"}), now=0.5
    )
    assert cs.states["p"].role == "decode" and "p" in seen  # a role change notifies the views
