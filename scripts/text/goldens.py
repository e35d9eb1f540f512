#!/usr/bin/env python3
"""Record the text-layer goldens of muser-text from the comparator (llama.cpp b11434).

Called by scripts/text-goldens.sh, which provides a Python with numpy and jinja2 and the
comparator's gguf-py on PYTHONPATH. Writes crates/muser-text/tests/golden/{tokenize,templates}.json.

Models:
  smollm2   SmolLM2-135M-Instruct Q4_1 (BPE, pre-tokenizer `smollm`)
  gemma3    Gemma 3 270M Q4_K_M (SentencePiece `llama` model, no chat template -> ChatML fallback)
  muse-*    synthetic muse-glimmer GGUFs built here with gguf-py: SmolLM2's tokens, token types
            and merges, the Muse special tokens appended as CONTROL tokens, bos = eos =
            `<|endoftext|>`, eot = `<|eot|>`, add_bos = true, the muse-glimmer chat template, and
            tiny random F32 tensors (seeded). One file per pre-tokenizer: llama-bpe, gpt-2, qwen2.
            crates/muser-text/tests/golden.rs rebuilds the same tokenizer metadata in memory from
            the SmolLM2 GGUF (see `muse_metadata` there): keep the two recipes identical.
"""
import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np
import gguf

MUSE_SPECIALS = ["<|start|>", "<|message|>", "<|eom|>", "<|eot|>", "<|patch|>", "<|video|>",
                 "<|image_start|>", "<|image_end|>"]
MUSE_PRES = ["llama-bpe", "gpt-2", "qwen2"]
PINNED_DATE = "2026-01-15"


# ----------------------------------------------------------------------------------------------
# corpus

def corpus():
    base = [
        "", " ", "  ", "   ", "\n", "\n\n", "\n\n\n", "\t", "\t\t", " \t\n ", "\r\n", "a\r\nb\r\n",
        "Hello world", "Hello, world!", " Hello", "Hello ", "hello   world  ", "  leading spaces",
        "trailing spaces   ", "tabs\tbetween\twords", "line one\nline two\n\nline four",
        "I'm you're they've we'll she'd it's", "I'M YOU'RE THEY'VE WE'LL SHE'D IT'S",
        "don't DON'T Don'T dOn'T", "'s 's' '' ' ' 'll 'LL", "rock 'n' roll", "O'Neil's",
        "1", "12", "123", "1234", "12345", "1234567", "12345678901234567890", "3.14159 2,718 1e10 0x1F",
        "a1b2c3", "version 2.0.1-beta+build.5", "2026-11-30T09:12:01Z", "$1,000,000.00", "-42 +17 ±3",
        "def add(a, b):\n    return a + b\n",
        "fn main() {\n    let x: Vec<u32> = vec![1, 2, 3];\n    println!(\"{:?}\", x);\n}\n",
        "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
        "{\"name\": \"Muser\", \"tokens\": [1, 2, 3], \"ok\": true, \"nested\": {\"k\": null}}",
        "<div class=\"note\"><p>Hello &amp; welcome</p></div>",
        "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
        "#!/bin/bash\nset -euo pipefail\necho \"$HOME\" | tr a-z A-Z\n",
        "    indented code\n        more indented\n\ttabbed",
        "x = [i**2 for i in range(10) if i % 2 == 0]",
        "The quick brown fox jumps over the lazy dog.",
        "Portez ce vieux whisky au juge blond qui fume. Ça coûte 5 €.",
        "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich.",
        "El pingüino Wenceslao hizo kilómetros bajo exhaustiva lluvia y frío, añoraba a su querido cachorro.",
        "Tiếng Việt có dấu: người, được, những, chữ Quốc ngữ.",
        "我能吞下玻璃而不伤身体。", "今日は良い天気ですね。カタカナとひらがな。", "다람쥐 헌 쳇바퀴에 타고파",
        "中文English混合mixed文本123", "Съешь же ещё этих мягких французских булок, да выпей чаю.",
        "Привет, мир! 2026 год.", "أبجد هوز حطي كلمن سعفص قرشت", "العربية ١٢٣٤٥٦ والأرقام",
        "שלום עולם", "नमस्ते दुनिया, यह देवनागरी लिपि है।", "हिन्दी में १२३ अंक", "สวัสดีชาวโลก",
        "Γειά σου Κόσμε", "Ελληνικά: αβγδε ΑΒΓΔΕ", "ქართული ენა", "Հայերեն", "বাংলা ভাষা", "தமிழ்",
        "😀", "😀😃😄", "Hello 👋 world 🌍!", "👨‍👩‍👧‍👦 family", "👩🏽‍💻 coder", "🏳️‍🌈 flag", "🇫🇷🇯🇵🇺🇸",
        "1️⃣2️⃣3️⃣", "❤️‍🔥", "emoji at end 🎉", "🧑‍🤝‍🧑", "e\u0301 combining", "A\u030a vs Å",
        "zero\u200bwidth\u200cjoiner\u200d", "non\u00a0breaking\u00a0space", "ideographic\u3000space",
        "line\u2028separator", "next\u0085line", "soft\u00adhyphen", "\u00bd \u00b2 \u2153 \u2460",
        "Ⅻ roman ⅻ", "ﬁ ligature", "ｆｕｌｌｗｉｄｔｈ　ＡＢＣ", "\ufeffBOM start",
        "<|im_start|>user\nHi<|im_end|>\n", "<|im_start|>assistant\nSure!<|im_end|>", "<|endoftext|>",
        "text<|endoftext|>more", "<|im_start|><|im_end|><|im_start|>", "<|im_", "<|im_end", "<|im_end|",
        "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", "<bos>hello<eos>", "<pad><unk><mask>",
        "<|start|>assistant to=self<|message|>think<|eom|>", "<|start|>user<|message|>Hi<|eot|>",
        "<|start|>assistant<|message|>x", "<|message|><|message|>", "<|eot|><|eom|>", "<|patch|><|patch|>",
        "<|image_start|><|patch|><|image_end|>", "<|start|", "<|start", "<|eot", "|>", "<||>",
        "<|unknown|>", "<|foo bar|>", "</s>", "<s>", "<unk>", "<0x41>", "[INST] hi [/INST]", "<<SYS>>",
        "<atem:function_calls>\n<atem:invoke name=\"f\">\n</atem:invoke>\n</atem:function_calls>",
        "<tool_output name=\"x\">\n42\n</tool_output>", "<think>hmm</think>", "<fim_prefix>a<fim_suffix>b<fim_middle>",
        "https://example.com/path?q=1&r=two#frag", "user.name+tag@example.co.uk", "C:\\Users\\me\\file.txt",
        "**bold** _italic_ `code` [link](http://x.y)", "# Title\n\n- item 1\n- item 2\n", "| a | b |\n|---|---|\n| 1 | 2 |",
        "$E = mc^2$ and \\frac{a}{b}", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "!!!!!!!!", "........", "--------", "========",
        "????", "...", "a.b.c", "hello!?", "wait... what?!", "'quoted' \"double\" `back`", "(parens) [brackets] {braces}",
        "         ", "\n \n \n", " \n", "\n ", "a \n b", "end with newline\n", "x\t\t\ty",
        "ALL CAPS SENTENCE HERE", "camelCaseIdentifier snake_case_name kebab-case-name", "__init__ __dunder__",
        "mixed123numbers456and789letters", "٣ Arabic-Indic ٤", "full-width digits １２３",
    ]
    seps = [" ", "\n", "", "  ", "\t", " \n"]
    rng = random.Random(11434)
    out = list(dict.fromkeys(base))
    while len(out) < 240:
        a, b = rng.choice(base), rng.choice(base)
        s = a + rng.choice(seps) + b
        if s not in out:
            out.append(s)
    long_text = "\n".join(base[12:80])
    out.append(long_text)
    return out


# ----------------------------------------------------------------------------------------------
# synthetic muse GGUFs

def muse_gguf(smol_path, pre, out_path):
    r = gguf.GGUFReader(smol_path)
    f = r.fields
    tokens = [bytes(f["tokenizer.ggml.tokens"].parts[i]).decode("utf-8") for i in f["tokenizer.ggml.tokens"].data]
    types = [int(f["tokenizer.ggml.token_type"].parts[i][0]) for i in f["tokenizer.ggml.token_type"].data]
    merges = [bytes(f["tokenizer.ggml.merges"].parts[i]).decode("utf-8") for i in f["tokenizer.ggml.merges"].data]
    eot = len(tokens) + MUSE_SPECIALS.index("<|eot|>")
    tokens += MUSE_SPECIALS
    types += [3] * len(MUSE_SPECIALS)
    template = open(os.path.join(ARGS.tree, "models/templates/muse-glimmer.jinja"), encoding="utf-8").read()

    n_vocab, n_embd, n_head, hd, n_ff = len(tokens), 16, 1, 16, 16
    w = gguf.GGUFWriter(out_path, "muse-glimmer")
    w.add_block_count(1)
    w.add_context_length(512)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(64)
    w.add_logit_scale(0.2)
    w.add_final_logit_softcapping(20.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_eot_token_id(eot)
    w.add_add_bos_token(True)
    w.add_chat_template(template)
    rng = np.random.default_rng(11434)

    def t(name, shape):
        w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))

    t("token_embd.weight", (n_vocab, n_embd))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    t("output.weight", (n_vocab, n_embd))
    for name in ["attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"]:
        w.add_tensor(f"blk.0.{name}.weight", np.ones(n_embd, dtype=np.float32))
    for name in ["attn_q_norm", "attn_k_norm"]:
        w.add_tensor(f"blk.0.{name}.weight", np.ones(hd, dtype=np.float32))
    for name in ["attn_q", "attn_k", "attn_v", "attn_gate"]:
        t(f"blk.0.{name}.weight", (n_head * hd, n_embd))
    t("blk.0.attn_output.weight", (n_embd, n_head * hd))
    t("blk.0.ffn_gate.weight", (n_ff, n_embd))
    t("blk.0.ffn_up.weight", (n_ff, n_embd))
    t("blk.0.ffn_down.weight", (n_embd, n_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ----------------------------------------------------------------------------------------------
# comparator

def env():
    e = dict(os.environ)
    if ARGS.lib_dir:
        e["LD_LIBRARY_PATH"] = ARGS.lib_dir
    return e


def free_port():
    while True:
        p = random.randint(40000, 60000)
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", p)) != 0:
                return p


class Server:
    def __init__(self, model):
        self.port = free_port()
        self.log = open(os.path.join(ARGS.work, f"server-{self.port}.log"), "w")
        self.proc = subprocess.Popen(
            [os.path.join(ARGS.bin, "llama-server"), "-m", model, "--host", "127.0.0.1", "--port", str(self.port),
             "--no-repack", "--no-warmup", "--jinja", "-c", "256", "-t", "1", "-np", "1"],
            stdout=self.log, stderr=subprocess.STDOUT, env=env())
        for _ in range(300):
            time.sleep(0.5)
            if self.proc.poll() is not None:
                raise SystemExit(f"llama-server exited ({self.proc.returncode}); see {self.log.name}")
            try:
                if json.loads(urllib.request.urlopen(self.url("/health"), timeout=2).read()).get("status") == "ok":
                    return
            except Exception:
                pass
        raise SystemExit("llama-server did not become healthy")

    def url(self, path):
        return f"http://127.0.0.1:{self.port}{path}"

    def post(self, path, body):
        req = urllib.request.Request(self.url(path), data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            return json.loads(urllib.request.urlopen(req, timeout=60).read())
        except urllib.error.HTTPError as e:
            return {"error": json.loads(e.read())}

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def llama_tokenize(model, text, parse_special):
    path = os.path.join(ARGS.work, "prompt.txt")
    with open(path, "wb") as f:
        f.write(text.encode("utf-8"))
    cmd = [os.path.join(ARGS.bin, "llama-tokenize"), "-m", model, "-f", path, "--ids", "--no-escape", "--log-disable"]
    if not parse_special:
        cmd.append("--no-parse-special")
    out = subprocess.run(cmd, capture_output=True, env=env(), check=True).stdout.decode()
    return json.loads(out.strip().splitlines()[-1])


def vocab_info(model):
    """BOS/EOS/EOT and the EOG set as llama.cpp prints them."""
    out = subprocess.run([os.path.join(ARGS.bin, "llama-tokenize"), "-m", model, "-p", "x", "--ids", "-lv", "4"],
                         capture_output=True, env=env()).stderr.decode(errors="replace")
    info = {"eog": []}
    for line in out.splitlines():
        if "print_info:" not in line or " token " not in line or "=" not in line:
            continue
        key, val = line.split("print_info:")[1].split("=", 1)
        key = key.strip().replace(" token", "").lower()
        tid = int(val.split()[0])
        if key == "eog":
            info["eog"].append(tid)
        elif key in ("bos", "eos", "eot", "eom"):
            info[key] = tid
    return info


# ----------------------------------------------------------------------------------------------
# conversations

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "search.web", "description": "Search the web: ünïcödé ok.", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "number"}}}}},
]


def conversations():
    user = {"role": "user", "content": "Hi"}
    common = [
        ("one user turn", {"messages": [user]}),
        ("with system", {"messages": [{"role": "system", "content": "You are terse."}, user]}),
        ("multi-turn", {"messages": [user, {"role": "assistant", "content": "Hello! How can I help?"},
                                     {"role": "user", "content": "Tell me a joke.\nA short one."}]}),
        ("no generation prompt", {"messages": [user, {"role": "assistant", "content": "Hey"}], "add_generation_prompt": False}),
        ("unicode", {"messages": [{"role": "user", "content": "¿Qué tal? 你好 👋 — «ok»"}]}),
        ("text parts", {"messages": [{"role": "user", "content": [{"type": "text", "text": "part one"},
                                                                  {"type": "text", "text": "part two"}]}]}),
    ]
    kw = {"chat_template_kwargs": {"current_date": PINNED_DATE}}
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": "{\"city\": \"Paris\", \"days\": 3}"}}]}
    muse = [
        ("muse: pinned date", dict(kw, messages=[user])),
        ("muse: tools offered", dict(kw, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS)),
        ("muse: tool call and result", dict(kw, tools=TOOLS, messages=[
            {"role": "user", "content": "Weather in Paris?"}, call,
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21.5, \"sky\": \"clear\"}"},
            {"role": "assistant", "content": "It is 21.5 °C and clear."}])),
        ("muse: tool result with name", dict(kw, tools=TOOLS, messages=[
            {"role": "user", "content": "Search"}, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c9", "type": "function", "function": {"name": "search.web", "arguments": {
                    "query": "rust", "limit": 5, "flags": [1, 2.5, True, None], "opts": {"safe": False}}}}]},
            {"role": "tool", "name": "search.web", "tool_call_id": "c9", "content": "results"}])),
        ("muse: parallel calls", dict(kw, tools=TOOLS, messages=[
            {"role": "user", "content": "Both"}, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}},
                {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\", \"days\": 2}"}}]},
            {"role": "tool", "tool_call_id": "a", "content": "cold"},
            {"role": "tool", "tool_call_id": "b", "content": "warm"}])),
        ("muse: reasoning content", dict(kw, messages=[
            user, {"role": "assistant", "reasoning_content": "The user greets me.", "content": "Hello!"},
            {"role": "user", "content": "Again"}])),
        ("muse: reasoning effort", dict(kw, messages=[user], reasoning_effort="low")),
        ("muse: system says reasoning effort", dict(kw, messages=[
            {"role": "system", "content": "Be brief. Reasoning effort: medium."}, user])),
        ("muse: system with tools", dict(kw, tools=TOOLS, messages=[{"role": "system", "content": "Use tools."}, user])),
        ("muse: no generation prompt", dict(kw, messages=[user, {"role": "assistant", "content": "Hey"}],
                                            add_generation_prompt=False)),
        ("muse: date from the clock", {"messages": [user]}),
    ]
    return common, muse


def image_conversation():
    return {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in "}, {"type": "image"}, {"type": "text", "text": " and "},
        {"type": "video"}, {"type": "text", "text": "?"}]}], "chat_template_kwargs": {"current_date": PINNED_DATE}}


def render_jinja2(source, conv, bos):
    """The Python jinja2 rendering that llama.cpp's engine reproduces for this template
    (used only where llama-server cannot take the input, e.g. images without a projector)."""
    import jinja2

    def raise_exception(msg):
        raise jinja2.exceptions.TemplateError(msg)

    e = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    e.globals["raise_exception"] = raise_exception
    e.filters["tojson"] = lambda v: json.dumps(v, ensure_ascii=False)
    ctx = dict(conv.get("chat_template_kwargs", {}))
    ctx.update(messages=conv["messages"], bos_token=bos, eos_token=bos, add_generation_prompt=True)
    out = e.from_string(source).render(**ctx)
    return out[len(bos):] if out.startswith(bos) else out


# ----------------------------------------------------------------------------------------------

def main():
    global ARGS
    p = argparse.ArgumentParser()
    p.add_argument("--bin", required=True)
    p.add_argument("--lib-dir", default="")
    p.add_argument("--tree", required=True)
    p.add_argument("--models", required=True)
    p.add_argument("--out", required=True)
    ARGS = p.parse_args()
    ARGS.work = tempfile.mkdtemp(prefix="muser-text-goldens-")

    smol = os.path.join(ARGS.models, "SmolLM2-135M-Instruct.Q4_1.gguf")
    gemma = os.path.join(ARGS.models, "gemma-3-270m-q4_k_m.gguf")
    models = {"smollm2": smol, "gemma3": gemma}
    for pre in MUSE_PRES:
        path = os.path.join(ARGS.work, f"muse-{pre}.gguf")
        muse_gguf(smol, pre, path)
        models[f"muse-{pre}"] = path

    texts = corpus()
    common, muse = conversations()
    tok_golden = {"comparator": "llama.cpp b11434 llama-server /tokenize and /detokenize, cross-checked with llama-tokenize --ids",
                  "corpus": texts, "models": {}}
    tmpl_golden = {"comparator": "llama.cpp b11434 llama-server /apply-template", "pinned_date": PINNED_DATE,
                   "cases": []}
    today = time.strftime("%Y-%m-%d")
    for name, path in models.items():
        print(f"[{name}] starting llama-server", file=sys.stderr)
        srv = Server(path)
        try:
            entry = {"vocab": vocab_info(path), "encode": [], "encode_no_special": [], "detokenize": []}
            for t in texts:
                ids = srv.post("/tokenize", {"content": t, "add_special": True, "parse_special": True})["tokens"]
                raw = srv.post("/tokenize", {"content": t, "add_special": True, "parse_special": False})["tokens"]
                entry["encode"].append(ids)
                entry["encode_no_special"].append(raw)
                det = srv.post("/detokenize", {"tokens": ids})
                entry["detokenize"].append(det.get("content"))
            for i in range(0, len(texts), 40):
                for special, key in ((True, "encode"), (False, "encode_no_special")):
                    ref = llama_tokenize(path, texts[i], special)
                    if ref != entry[key][i]:
                        raise SystemExit(f"[{name}] llama-tokenize and /tokenize disagree on text {i}: {ref} vs {entry[key][i]}")
            tok_golden["models"][name] = entry
            convs = list(common)
            if name == "muse-llama-bpe":
                convs += muse
            elif name.startswith("muse-"):
                convs = []
            for label, conv in convs:
                body = dict(conv)
                res = srv.post("/apply-template", body)
                if "prompt" not in res:
                    raise SystemExit(f"[{name}] /apply-template failed for {label}: {res}")
                # The day the server rendered on: templates that print the current date read
                # the clock, and the test renders with this date instead of its own clock.
                case = {"model": name, "label": label, "request": conv, "prompt": res["prompt"],
                        "date": today}
                tmpl_golden["cases"].append(case)
        finally:
            srv.close()
    if today != time.strftime("%Y-%m-%d"):
        raise SystemExit("the date changed while recording; run again")
    # Images: llama-server takes image parts only with a projector, so this one case is the
    # jinja2 rendering of the same template (llama.cpp's engine was verified equal to it).
    src = open(os.path.join(ARGS.tree, "models/templates/muse-glimmer.jinja"), encoding="utf-8").read()
    conv = image_conversation()
    tmpl_golden["cases"].append({"model": "muse-llama-bpe", "label": "muse: image and video parts (jinja2)",
                                 "request": conv, "prompt": render_jinja2(src, conv, "<|endoftext|>")})

    os.makedirs(ARGS.out, exist_ok=True)
    with open(os.path.join(ARGS.out, "tokenize.json"), "w", encoding="utf-8") as f:
        json.dump(tok_golden, f, ensure_ascii=False, separators=(",", ":"))
    with open(os.path.join(ARGS.out, "templates.json"), "w", encoding="utf-8") as f:
        json.dump(tmpl_golden, f, ensure_ascii=False, indent=1)
    print(f"wrote {ARGS.out}/tokenize.json ({len(texts)} texts x {len(models)} models) and templates.json "
          f"({len(tmpl_golden['cases'])} renders)", file=sys.stderr)


if __name__ == "__main__":
    main()
