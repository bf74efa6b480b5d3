"""`moerun serve --spec-type ngram`: answers are plain decoding's, and /metrics counts the
verifies, drafts and accepted tokens."""
from __future__ import annotations

import openai

from tests.server.live import TIMEOUT_S, live_server, metric, scrape

PROMPT = "one two three four one two three four one two three"


def test_a_speculating_server_answers_as_plain_decoding(demo_model, moerun, tmp_path):
    plain = moerun("run", "-m", demo_model, "--chat", "-p", PROMPT, "--temp", "0", "-n", "32")
    assert plain.exit_code == 0, plain.output
    with live_server(tmp_path / "server.log", "-m", demo_model, "--spec-type", "ngram", "--no-spec-gate") as (url, _):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S) as client:
            reply = client.chat.completions.create(model="demo-moe-v2", messages=[{"role": "user", "content": PROMPT}],
                                                   temperature=0, max_tokens=32)
        samples = scrape(url)
    assert reply.choices[0].message.content == plain.stdout.removesuffix("\n")
    verifies = metric(samples, "moerun_spec_verify_steps_total")
    assert verifies > 0 and metric(samples, "moerun_spec_drafted_tokens_total") >= verifies
    assert metric(samples, "moerun_spec_accepted_tokens_total") <= metric(samples, "moerun_spec_drafted_tokens_total")
