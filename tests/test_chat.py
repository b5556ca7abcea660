"""Chat data: records rendered by a chat template, the loss mask on the tokens data.train_on picks,
carried through packing into every batch; and a chat run's loss is the masked mean."""

import json

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import main_cli
from jaxscale.config import defaults
from jaxscale.data import chat, make_data
from jaxscale.data.tokenize import ByteTokenizer
from jaxscale.errors import ConfigError

TALK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6, of course"}]


def _trained(folder, record, train_on, template=chat.CHATML):
    """(the text of the trained tokens, of all tokens) of one record as the source encodes it."""
    path = _write(folder, [record])
    tokens, mask = chat.encode(path, chat.Template(template, {}, "t"), ByteTokenizer(), train_on)
    assert tokens.shape == mask.shape and tokens[-1] == ByteTokenizer.eos_id  # each record ends with EOS
    text = bytes(tokens[:-1].astype(np.uint8)).decode()
    return bytes(tokens[mask == 1].astype(np.uint8)).decode(), text, int(mask[-1])


def _write(folder, records, name="chat.jsonl"):
    path = folder / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_assistant_turns_are_trained_with_their_end_of_turn_and_nothing_else(tmp_path):
    trained, text, eos = _trained(tmp_path, {"messages": TALK}, "assistant")
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                    "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nand 3+3?<|im_end|>\n"
                    "<|im_start|>assistant\n6, of course<|im_end|>\n")
    assert trained == "4<|im_end|>\n" + "6, of course<|im_end|>\n" and eos == 0
    assert _trained(tmp_path, {"messages": TALK}, "completion")[0] == "6, of course<|im_end|>\n"
    trained, text, eos = _trained(tmp_path, {"messages": TALK}, "all")
    assert trained == text + "\0" and eos == 1


def test_a_prompt_and_completion_are_joined_and_the_completion_and_its_eos_trained(tmp_path):
    trained, text, eos = _trained(tmp_path, {"prompt": "Q: 2+2? A:", "completion": " 4"}, "assistant")
    assert text == "Q: 2+2? A: 4" and trained == " 4\0" and eos == 1
    # Message lists: rendered as one conversation, the completion's turns trained.
    record = {"prompt": TALK[:4], "completion": TALK[4:]}
    assert _trained(tmp_path, record, "assistant")[0] == "6, of course<|im_end|>\n"


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_field(tmp_path):
    # Numbers each turn from the end: adding a turn changes the text before it.
    template = "{% for m in messages %}[{{ messages|length - loop.index }}]{{ m['content'] }}{% endfor %}"
    with pytest.raises(ConfigError, match="data.chat_template.*not a prefix"):
        _trained(tmp_path, {"messages": TALK}, "assistant", template)


def test_transformers_template_tags_render():
    """{% generation %} (transformers' assistant marker) renders its body; {% break %} works."""
    template = chat.Template("{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}|{% else %}"
                             "{% generation %}{{ m['content'] }}{% endgeneration %}{% break %}{% endif %}"
                             "{% endfor %}", {}, "t")
    assert template.render(TALK[1:], add_generation_prompt=False) == "2+2?|4"


def test_the_tokenizers_own_template_and_special_tokens_are_used(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"}, "eos_token": "</s>",
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}"
                         "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"}))
    template = chat.load_template("", str(tmp_path / "tokenizer.json"))
    assert template.render(TALK[1:3], add_generation_prompt=False) == "<s>user: 2+2?</s>assistant: 4</s>"
    with pytest.raises(ConfigError, match="data.chat_template"):
        chat.load_template("", str(tmp_path / "elsewhere" / "tokenizer.json"))


def _config(path, **data):
    config = defaults()
    config.data.update(path=str(path), val_fraction=0.2, **data)
    config.train.update(seq_len=32, global_batch_size=8)
    config.model.vocab_size = 256
    return config


def test_batches_carry_the_mask_of_their_targets(tmp_path):
    records = [{"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": f"{i} " * 5}]}
               for i in range(60)]
    path = _write(tmp_path, records)
    tokens, mask = chat.encode(path, chat.Template(chat.CHATML, {}, "t"), ByteTokenizer(), "assistant")
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices())
    data = make_data(_config(path, chat_template="chatml"), NamedSharding(mesh, P("data", None)))
    assert any("chat data:" in note and "trained" in note for note in data.notes)
    batch = data.local_batch(0)
    assert set(batch) == {"inputs", "targets", "mask"}
    # Each row's window is found in the stream, and its mask is the stream's mask of its targets.
    stream = tokens.astype(np.int32)
    for inputs, targets, row_mask in zip(batch["inputs"], batch["targets"], batch["mask"]):
        window = np.concatenate([inputs, targets[-1:]])
        start = next(i for i in range(len(stream) - 32) if np.array_equal(stream[i:i + 33], window))
        np.testing.assert_array_equal(row_mask, mask[start + 1:start + 33])
    assert 0 < batch["mask"].sum() < batch["mask"].size


def test_a_mixture_of_chat_and_text_trains_every_text_token(tmp_path):
    talks = [{"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": f"{i}"}]}
             for i in range(100)]
    chats = _write(tmp_path, talks)
    (tmp_path / "plain.txt").write_text("plain text " * 300)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices())
    config = _config("", chat_template="chatml", mixture=f"chat={chats}:0.5,text={tmp_path / 'plain.txt'}:0.5")
    data = make_data(config, NamedSharding(mesh, P("data", None)))
    rows = [data.splits[1].train[i] for i in range(3)] + [data.splits[0].train[i] for i in range(3)]
    assert all(set(row) == {"inputs", "targets", "mask"} for row in rows)
    assert all(row["mask"].all() for row in rows[:3]) and not all(row["mask"].all() for row in rows[3:])
    assert set(data.local_batch(0)) == {"inputs", "targets", "mask"}


def test_chat_records_beside_text_in_one_source_are_refused(tmp_path):
    path = _write(tmp_path, [{"messages": TALK}])
    (path.parent / "plain.txt").write_text("text " * 100)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices())
    with pytest.raises(ConfigError, match="data.path.*not chat records"):
        make_data(_config(f"{path},{path.parent / 'plain.txt'}"), NamedSharding(mesh, P("data", None)))


def test_a_chat_run_trains_on_the_answers_only(tmp_path):
    """The CLI on chat records: each logged step says how many of its targets it trained."""
    records = [{"messages": [{"role": "user", "content": f"echo {i % 10}"},
                             {"role": "assistant", "content": f"{i % 10}{i % 10}{i % 10}"}]} for i in range(400)]
    path = _write(tmp_path, records)
    out = main_cli(["--config=configs/tiny.py", f"--config.data.path={path}", "--config.data.chat_template=chatml",
                    "--config.train.steps=3", "--config.train.seq_len=64", "--config.train.global_batch_size=8",
                    f"--workdir={tmp_path / 'run'}"])
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [(m["trained_tokens"], m["trained_tokens_per_sec"]) for m in metrics if "loss" in m]
    assert trained and all(0 < t < 8 * 64 and rate > 0 for t, rate in trained)


def test_a_token_store_of_chat_records_carries_their_mask(tmp_path):
    """python -m jaxscale.prepare renders chat records once, with their loss mask beside the ids:
    training from the store reads the same windows and masks as from the records; a store made
    with another train_on, or chat records beside text in one prepare, is refused in one line."""
    from jaxscale.prepare import prepare

    records = [{"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": f"{i} " * 3}]}
               for i in range(120)]
    path = _write(tmp_path, records)
    flags = {"input": str(path), "out": str(tmp_path / "store"), "workers": 1, "progress": False,
             "chat_template": "chatml"}
    manifest = prepare(flags, say=lambda _: None)
    assert manifest["chat"] == {"template": "chatml", "train_on": "assistant"}
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices())
    sharding = NamedSharding(mesh, P("data", None))
    direct = make_data(_config(path, chat_template="chatml"), sharding)
    stored = make_data(_config(tmp_path / "store"), sharding)
    assert stored.num_train_tokens == direct.num_train_tokens
    for step in range(3):
        a, b = direct.local_batch(step), stored.local_batch(step)
        assert set(a) == set(b) == {"inputs", "targets", "mask"}
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    with pytest.raises(ConfigError) as info:
        make_data(_config(tmp_path / "store", train_on="all"), sharding)
    assert info.value.field == "data.train_on" and "--train_on=all" in str(info.value)
    (tmp_path / "plain.txt").write_text("plain text " * 30)
    with pytest.raises(ConfigError, match="--input.*not chat records"):
        prepare({**flags, "input": f"{path},{tmp_path / 'plain.txt'}", "out": str(tmp_path / "other")})
