"""Chat templates read from GGUF metadata, rendered against transformers' apply_chat_template on the same template."""

import pytest
from transformers import PreTrainedTokenizerFast

from moerun.gguf.chat import DEFAULT_CHATML, ChatTemplateError, render_chat
from moerun.gguf.tokenizer import Tokenizer, TokenizerError
from moerun.gguf.vocab import bpe_metadata
from tests.support.vocabs import byte_level_tokenizer

QWEN_CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

MIXTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

# Exercises what Hugging Face templates lean on: namespaces, loop controls, tojson, strftime_now, tools.
HELPERS = """
{%- set ns = namespace(turns=0) -%}
{%- for message in messages -%}
    {%- if message.role == 'system' -%}{%- continue -%}{%- endif -%}
    {%- set ns.turns = ns.turns + 1 %}
{{ ns.turns }}: {{ message | tojson }}
{%- endfor %}
{% if tools %}
    {{ tools | tojson(indent=2) }}
{% endif %}
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>{% endif %}
year {{ strftime_now('%Y') }}
"""

CONVERSATION = [
    {"role": "user", "content": "Wie spät ist es in 東京? 🙂"},
    {"role": "assistant", "content": "Es ist  kurz nach\nneun."},
    {"role": "user", "content": "  Danke!  "},
]
WITH_SYSTEM = [{"role": "system", "content": "Answer briefly."}, *CONVERSATION]
TOOLS = [{"type": "function", "function": {"name": "clock", "description": "Zeit — jetzt", "parameters": {}}}]


@pytest.fixture(scope="module")
def trained():
    return byte_level_tokenizer(600, ["<s>", "</s>", "<|im_start|>", "<|im_end|>"])


@pytest.fixture(scope="module")
def oracle(trained):
    return PreTrainedTokenizerFast(tokenizer_object=trained, bos_token="<s>", eos_token="</s>")


def tokenizer_with(trained, template):
    return Tokenizer.from_metadata(bpe_metadata(trained, pre="qwen2", bos="<s>", eos="</s>", chat_template=template))


def render_from_file(tokenizer, messages, **kwargs):
    return render_chat(
        tokenizer.chat_template,
        messages,
        bos_token=tokenizer.token_text(tokenizer.bos_id),
        eos_token=tokenizer.token_text(tokenizer.eos_id),
        **kwargs,
    )


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize(
    "template, messages",
    [(QWEN_CHATML, WITH_SYSTEM), (QWEN_CHATML, CONVERSATION), (MIXTRAL, CONVERSATION), (DEFAULT_CHATML, WITH_SYSTEM)],
    ids=["chatml-system", "chatml-default-system", "mixtral", "default-chatml"],
)
def test_template_from_metadata_renders_like_transformers(trained, oracle, template, messages, add_generation_prompt):
    tokenizer = tokenizer_with(trained, template)
    assert tokenizer.chat_template == template
    expected = oracle.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert render_from_file(tokenizer, messages, add_generation_prompt=add_generation_prompt) == expected


def test_rendered_chatml_prompt_encodes_its_special_tokens(trained):
    tokenizer = tokenizer_with(trained, DEFAULT_CHATML)
    ids = tokenizer.encode(render_from_file(tokenizer, WITH_SYSTEM))
    assert ids.count(trained.token_to_id("<|im_start|>")) == len(WITH_SYSTEM) + 1
    assert ids.count(trained.token_to_id("<|im_end|>")) == len(WITH_SYSTEM)


def test_template_helpers_and_variables_render_like_transformers(trained, oracle):
    tokenizer = tokenizer_with(trained, HELPERS)
    expected = oracle.apply_chat_template(
        WITH_SYSTEM, chat_template=HELPERS, tools=TOOLS, enable_thinking=False, tokenize=False
    )
    assert render_from_file(tokenizer, WITH_SYSTEM, tools=TOOLS, enable_thinking=False) == expected
    assert "東京" in expected and "— jetzt" in expected and "<think>" in expected


def test_file_without_template_has_none(trained):
    assert tokenizer_with(trained, None).chat_template is None


def test_raise_exception_in_template_is_a_clear_error(oracle):
    messages = [{"role": "assistant", "content": "I speak first."}]
    with pytest.raises(Exception, match="roles must alternate"):
        oracle.apply_chat_template(messages, chat_template=MIXTRAL, tokenize=False)
    with pytest.raises(ChatTemplateError, match="rejected the conversation: Conversation roles must alternate"):
        render_chat(MIXTRAL, messages, bos_token="<s>", eos_token="</s>")


def test_syntax_error_names_the_line():
    broken = "{% for message in messages %}\n{{ message['content'] }\n{% endfor %}"
    with pytest.raises(ChatTemplateError, match="syntax error on line 2") as raised:
        render_chat(broken, CONVERSATION, bos_token="", eos_token="")
    assert isinstance(raised.value, TokenizerError)


def test_template_cannot_modify_its_inputs():
    sneaky = "{{ messages.append({'role': 'system', 'content': 'obey'}) }}"
    with pytest.raises(ChatTemplateError, match="failed to render: SecurityError"):
        render_chat(sneaky, list(CONVERSATION), bos_token="", eos_token="")
