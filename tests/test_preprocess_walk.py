"""docs/preprocessing.md followed as a new user would, on data no one here wrote: images from
matplotlib's and scikit-learn's sample data (and kinds Pillow makes from them: 16-bit,
CMYK, palette, tiny), text from the standard library's sources. Each test pins a defect
the walk found."""

from __future__ import annotations

import io
import json
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from datagen import tar_archive
from typer.testing import CliRunner

from edgecache.cache.errors import MalformedShard
from edgecache.cache.manifest import preprocess_spec
from edgecache.cache.preprocess import ShardContext, load_transform, preprocess
from edgecache.cache.registry import Registry
from edgecache.v1 import manifest_pb2 as pb

Image = pytest.importorskip("PIL.Image")
mpl = pytest.importorskip("matplotlib")
SAMPLES = Path(mpl.get_data_path()) / "sample_data"
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def grace() -> bytes:
    return (SAMPLES / "grace_hopper.jpg").read_bytes()


def china() -> bytes:
    """scikit-learn's 640x427 photo: a real JPEG whose crop box rounding went negative."""
    sklearn = pytest.importorskip("sklearn")
    return (Path(sklearn.__file__).parent / "datasets/images/china.jpg").read_bytes()


def encoded(image: object, fmt: str, **kw: object) -> bytes:
    sink = io.BytesIO()
    image.save(sink, fmt, **kw)  # type: ignore[attr-defined]
    return sink.getvalue()


def png16() -> tuple[bytes, np.ndarray]:
    """A 16-bit grayscale PNG of grace_hopper.jpg, and the 8-bit gray it was made from."""
    gray = np.asarray(Image.open(io.BytesIO(grace())).convert("L"))
    return encoded(Image.fromarray(gray.astype(np.uint16) * 257), "PNG"), gray


def arrow_ipc(batch: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def decode(images: list[bytes], **params: str) -> np.ndarray:
    """The images transform's pixels for ``images``, as ``[N, H, W, C]``."""
    batch = pa.RecordBatch.from_pydict({"image": pa.array(images, pa.binary())})
    out = preprocess(
        arrow_ipc(batch),
        fmt=pb.SOURCE_FORMAT_ARROW_IPC,
        source="s3://b/imgs/part-0.arrow",
        spec=pb.PreprocessSpec(transform="images", params=params),
        context=ShardContext(),
    )
    table = pa.Table.from_batches(list(out))
    kind = table.schema.field("image").type
    shape = []
    while pa.types.is_fixed_size_list(kind):
        shape.append(kind.list_size)
        kind = kind.value_type
    flat = table.column("image").combine_chunks().flatten().flatten().flatten()
    return np.asarray(flat).reshape(len(table), *shape)


@pytest.mark.parametrize("size", ["32", "64", "100", "224", "427"])
def test_a_real_jpeg_crops_at_any_size(size: str) -> None:
    # china.jpg at size=64 failed: 'box offset can't be negative' (top = -7e-15).
    out = decode([china()], size=size)
    assert out.shape == (1, int(size), int(size), 3)


def test_16_bit_png_keeps_its_levels() -> None:
    # A 16-bit PNG came out all 255: Pillow clips 16-bit values when converting to 8 bits.
    data, gray = png16()
    for channels in ("gray", "rgb"):
        out = decode([data], height=str(gray.shape[0]), width=str(gray.shape[1]),
                     channels=channels, filter="nearest")  # fmt: skip
        assert np.array_equal(out[0, :, :, 0], gray)


def test_output_naming_another_column_is_refused_at_publish(tmp_path: Path) -> None:
    # output=cls published two columns named cls; every node then failed the shard.
    origin = tmp_path / "origin"
    origin.mkdir()
    (origin / "s-0.tar").write_bytes(tar_archive([("a.cls", b"1"), ("a.jpg", grace())]))
    spec = preprocess_spec(transform="images", params={"size": "8", "output": "cls"})
    with pytest.raises(MalformedShard, match="output='cls' is already a column"):
        Registry.run(
            f"file://{tmp_path}/reg", lambda reg: reg.publish(f"file://{origin}", "p", spec=spec)
        )


@pytest.fixture(scope="module")
def tokenizer_json() -> bytes:
    tokenizers = pytest.importorskip("tokenizers")
    docs = [(STDLIB / name).read_text() for name in ("textwrap.py", "shlex.py", "colorsys.py")]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<pad>", "<unk>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(docs, trainer)
    return tok.to_str().encode()


def pack(texts: list[str | None], tok: bytes, **params: str) -> pa.Table:
    data = b"".join(json.dumps({"text": t}).encode() + b"\n" for t in texts)
    out = preprocess(
        data,
        fmt=pb.SOURCE_FORMAT_JSONL,
        source="s3://b/docs/part-0.jsonl",
        spec=pb.PreprocessSpec(transform="tokens", params={"tokenizer": "t", **params}),
        resources={"t": tok},
        batch_rows=2,
        context=ShardContext(),
    )
    return pa.Table.from_batches(list(out))


def test_empty_documents_are_not_listed_in_doc_starts(tokenizer_json: bytes) -> None:
    # Empty documents were listed: [0, 0, 1, 1] for ['', 'ab', '', 'cd'], and a trailing
    # empty one pointed into the padding. doc_starts must be where tokens of a document begin.
    texts: list[str | None] = ["", "ab", None, "", "cd", "日本語 😀", ""]
    table = pack(texts, tokenizer_json, seq_len="4")
    for starts, length in zip(
        table.column("doc_starts").to_pylist(), table.column("length").to_pylist(), strict=True
    ):
        assert starts == sorted(set(starts)) and all(s < length for s in starts)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json.decode())
    sizes = [len(tok.encode(t, add_special_tokens=False).ids) for t in ("ab", "cd", "日本語 😀")]
    flat_starts = [
        row * 4 + s for row, starts in enumerate(table.column("doc_starts").to_pylist())
        for s in starts
    ]  # fmt: skip
    assert flat_starts == [0, sizes[0], sizes[0] + sizes[1]]


def test_pad_id_and_vocabulary_that_do_not_fit_dtype_are_refused_as_params(
    tokenizer_json: bytes,
) -> None:
    # pad_id=70000 with dtype=uint16 failed on the object ('token id 70000 … fix or remove
    # the object'): it is the param that is wrong, and it can be seen before any data.
    with pytest.raises(ValueError, match="pad_id=70000 does not fit dtype uint16"):
        load_transform("tokens", {"tokenizer": "t", "dtype": "uint16", "pad_id": "70000"},
                       {"t": tokenizer_json})  # fmt: skip
    big = json.loads(tokenizer_json)
    big["model"]["vocab"].update({f"<extra_{i}>": 500 + i for i in range(70_000)})
    with pytest.raises(ValueError, match="vocabulary .* dtype uint16 .*dtype=uint32"):
        load_transform("tokens", {"tokenizer": "t", "dtype": "uint16"},
                       {"t": json.dumps(big).encode()})  # fmt: skip


def test_repeated_or_bare_param_is_refused_naming_it(tmp_path: Path) -> None:
    # '--param cast=a=int8 --param cast=b=float16' said '--param takes KEY=VALUE'.
    from edgecache.clients.cli import app

    runner = CliRunner()
    base = ["publish", str(tmp_path), "--dataset", "d", "--registry", f"file://{tmp_path}/r"]
    twice = runner.invoke(app, [*base, "--transform", "columns", "--param", "cast=a=int8",
                                "--param", "cast=b=float16"])  # fmt: skip
    assert twice.exit_code == 2
    assert "cast" in twice.output and "more than once" in twice.output
    bare = runner.invoke(app, [*base, "--param", "size"])
    assert bare.exit_code == 2 and "'size'" in bare.output


def test_real_images_publish_stage_on_two_nodes_and_read_back(tmp_path: Path) -> None:
    """Every kind of image the walk used, through the CLI, two real nodes and EdgeDataset:
    the schema `versions` prints is what EdgeDataset yields, and both nodes give the same
    bytes."""
    torch = pytest.importorskip("torch")
    from edgecache.clients.cli import app
    from edgecache.clients.dataset import EdgeDataset
    from edgecache.edge.config import NodeConfig
    from edgecache.edge.server import running_node

    base = Image.open(io.BytesIO(grace()))
    exif = base.getexif()
    exif[0x0112] = 6  # "rotate 90° to display": not applied, as documented
    kinds = {
        "jpeg": grace(),
        "china": china(),
        "logo": (SAMPLES / "logo2.png").read_bytes(),  # RGBA
        "palette": encoded(base.convert("P", palette=Image.Palette.ADAPTIVE), "PNG"),
        "png16": png16()[0],
        "cmyk": encoded(base.convert("CMYK"), "JPEG"),
        "exif": encoded(base, "JPEG", exif=exif.tobytes()),
        "tiny": encoded(base.resize((3, 2)), "PNG"),
    }
    origin = tmp_path / "origin"
    origin.mkdir()
    for shard in range(2):
        members = []
        for i, (kind, data) in enumerate(kinds.items()):
            members += [(f"s{shard}/{kind}.cls", b"%d" % i), (f"s{shard}/{kind}.jpg", data)]
        (origin / f"shard-{shard}.tar").write_bytes(tar_archive(members))
    registry = f"file://{tmp_path}/registry"
    runner = CliRunner()
    args = ["--dataset", "pics", "--registry", registry, "--transform", "images"]
    published = runner.invoke(app, ["publish", str(origin), *args, "--param", "size=48"])
    assert published.exit_code == 0, published.output
    assert "jpg: uint8[48,48,3]" in published.output
    listed = runner.invoke(app, ["versions", "pics", "--registry", registry, "--json"])
    schema = {f["name"]: f["type"] for f in json.loads(listed.output)[0]["schema"]}
    assert schema["jpg"].startswith("fixed_size_list") and schema["cls"] == "int64"
    seen = []
    for node_dir in ("n1", "n2"):
        config = NodeConfig(region=node_dir, cache_dir=tmp_path / node_dir, registry=registry,
                            listen="127.0.0.1:0", sync=False)  # fmt: skip
        with running_node(config) as node:
            ds = EdgeDataset("pics@1", endpoints=[node.address], batch_size=4, shuffle=False)
            batches = list(ds)
        assert set(batches[0]) == set(schema)
        seen.append(torch.cat([b["jpg"] for b in batches]))
    assert seen[0].shape == (16, 48, 48, 3) and seen[0].dtype == torch.uint8
    assert torch.equal(seen[0], seen[1])  # the same bytes from two nodes
    pixels = dict(zip(kinds, seen[0][:8].numpy(), strict=True))
    assert pixels["png16"].mean() < 200  # not clipped to white
    unrotated = np.abs(pixels["exif"].astype(int) - pixels["jpeg"]).mean()
    rotated = np.abs(np.rot90(pixels["exif"], -1).astype(int) - pixels["jpeg"]).mean()
    assert unrotated < 5 < rotated  # EXIF orientation is not applied, as documented


def documented_params(transform: str) -> set[str]:
    """The params in the table of ``### `<transform>``` in docs/preprocessing.md."""
    doc = (Path(__file__).parents[1] / "docs/preprocessing.md").read_text()
    section = doc.split(f"### `{transform}`", 1)[1].split("\n### ", 1)[0]
    names: set[str] = set()
    for row in section.splitlines():
        if row.startswith("| `"):
            cell = row.split("|")[1]
            names.update(part.split("=")[0] for part in cell.split("`")[1::2])
    return names


@pytest.mark.parametrize("transform", ["images", "tokens", "columns"])
def test_every_param_a_transform_parses_is_documented(transform: str) -> None:
    # tokens parsed pad_id, which the params table did not list.
    from edgecache.cache.preprocess import images, text

    parsed = {
        "images": set(images._PARAMS),
        "tokens": set(text._PARAMS),
        "columns": {"select", "rename", "cast"},
    }[transform]
    assert parsed <= documented_params(transform)
    with pytest.raises(ValueError, match="unknown params.*allowed") as info:
        load_transform(transform, {"tokenizer": "t", "size": "8", "sise": "8"}, {"t": b""})
    if transform == "images":  # a typo of a name it takes: the likely one is offered
        assert "'sise' (did you mean 'size'?)" in str(info.value)


def test_a_column_a_parameter_names_wrongly_says_to_fix_the_parameter(tmp_path: Path) -> None:
    """A typo in select=/column_types is found on the first object at publish; the advice
    named only the object ('fix or remove the object and publish a new version')."""
    origin = tmp_path / "origin"
    origin.mkdir()
    (origin / "a.csv").write_text("x,y\n1,2\n")
    registry = f"file://{tmp_path}/reg"
    typo = preprocess_spec(transform="columns", params={"select": "x,yy"})
    with pytest.raises(MalformedShard, match="'yy'.*is missing") as info:
        Registry.run(registry, lambda reg: reg.publish(f"file://{origin}", "s", spec=typo))
    assert "if the parameter that names it is wrong, fix it" in str(info.value)
    types = preprocess_spec()
    types.source_options["column_types"] = "nope=int32"
    with pytest.raises(MalformedShard, match="nope") as info:
        Registry.run(registry, lambda reg: reg.publish(f"file://{origin}", "t", spec=types))
    assert "if the parameter that names it is wrong, fix it" in str(info.value)


def _publish_error(tmp_path: Path, name: str, files: dict[str, bytes], **spec: object) -> str:
    origin = tmp_path / name
    origin.mkdir()
    for key, data in files.items():
        (origin / key).write_bytes(data)
    options = spec.pop("source_options", {})
    preprocess_ = preprocess_spec(**spec)  # type: ignore[arg-type]
    preprocess_.source_options.update(options)  # type: ignore[arg-type]
    registry = f"file://{tmp_path}/reg"
    with pytest.raises(MalformedShard) as info:
        Registry.run(registry, lambda reg: reg.publish(f"file://{origin}", name, spec=preprocess_))
    return str(info.value)


def test_reader_options_that_do_not_match_the_file_are_named_as_the_likely_fix(
    tmp_path: Path,
) -> None:
    """A column count or rows to skip that do not fit the file said only 'fix or remove
    the object', when the options were what to fix."""
    names = _publish_error(
        tmp_path,
        "names",
        {"a.csv": b"1,2,3\n4,5,6\n"},
        source_options={"column_names": "x,y,z,w"},
    )
    assert "Expected 4 columns, got 3" in names
    # The option is what to fix, and the message says so with both counts.
    assert "--column-names gives 4 names (x, y, z, w), but its rows hold 3 values" in names
    assert "fix or remove the object" not in names
    # Without options, the object is what to fix.
    plain = _publish_error(tmp_path, "plain", {"a.csv": b"x,y\n1,2\n3\n"})
    assert plain.endswith("fix or remove the object and publish a new version")
    assert "reader options" not in plain


def test_a_webdataset_error_is_the_readers_once_not_the_transforms() -> None:
    """The tar reader parses lazily, inside the transform's loop: its error was labelled
    the transform's and carried the advice twice."""
    data = tar_archive([("k1.cls", b"cat"), ("k1.txt", b"hello")])
    spec = pb.PreprocessSpec(transform="columns", params={"select": "cls"})
    with pytest.raises(MalformedShard) as info:
        list(preprocess(data, fmt=pb.SOURCE_FORMAT_WEBDATASET, source="s3://b/a.tar", spec=spec))
    message = str(info.value)
    assert "not an integer" in message
    assert "transform 'columns'" not in message
    assert message.count("fix or remove the object") == 1


def test_a_text_member_that_is_not_utf8_is_refused_at_publish_naming_the_sample(
    tmp_path: Path,
) -> None:
    """Only integer members were checked at publish: a .txt member in Latin-1 published,
    then every node failed the shard at staging with an error naming no sample."""
    members = [("k1.txt", b"fine"), ("k1.cls", b"1")]
    members += [("k2.txt", "caf\xe9".encode("latin-1")), ("k2.cls", b"2")]
    message = " ".join(_publish_error(tmp_path, "wds", {"s-0.tar": tar_archive(members)}).split())
    assert "sample 'k2'" in message and "k2.txt is not UTF-8 text" in message, message
    assert "(.bin)" in message, message
    # A version published before the check: the reader names the sample too.
    spec = pb.PreprocessSpec(transform="identity")
    with pytest.raises(MalformedShard, match="sample 'k2'"):
        list(
            preprocess(
                tar_archive(members),
                fmt=pb.SOURCE_FORMAT_WEBDATASET,
                source="s3://b/s-0.tar",
                spec=spec,
            )
        )


def test_a_param_that_does_not_fit_the_data_says_to_fix_the_param(tmp_path: Path) -> None:
    rows = b'{"text": "hello", "n": 1}\n'
    wrong_type = _publish_error(
        tmp_path,
        "img",
        {"a.jsonl": rows},
        transform="images",
        params={"size": "8", "column": "text"},
    )
    assert "column 'text' is string, not binary" in wrong_type
    assert wrong_type.endswith("fix the --param and publish again; if only this object "
                               "differs from the others, fix or remove it and publish a new "
                               "version")  # fmt: skip


def test_empty_params_and_nested_csv_types_are_refused_at_publish(tmp_path: Path) -> None:
    origin = tmp_path / "origin"
    origin.mkdir()
    (origin / "a.csv").write_text("x,y\n1,2\n")
    registry = f"file://{tmp_path}/reg"
    for params in ({"select": ""}, {"rename": " ", "cast": "x=int8"}):
        spec = preprocess_spec(transform="columns", params=params)
        with pytest.raises(ValueError, match="no value; give one, or leave the param out"):
            Registry.run(registry, lambda reg, s=spec: reg.publish(f"file://{origin}", "e", spec=s))
    nested = preprocess_spec()
    nested.source_options["column_types"] = "y=list<int32>"
    with pytest.raises(ValueError, match="a CSV cell holds one value"):
        Registry.run(registry, lambda reg: reg.publish(f"file://{origin}", "n", spec=nested))
    assert not (tmp_path / "reg").exists() or not list((tmp_path / "reg").glob("*/versions/*"))
