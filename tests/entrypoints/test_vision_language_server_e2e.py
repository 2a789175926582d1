"""``tokenloom serve`` with a vision-language model (a tiny random LLaVA saved with the
default model's tokenizer, its image processor and chat template), over HTTP.

The official ``openai`` client sends a base64 PNG and gets an answer. Every bad image
is refused with 400 naming the content part (413 over ``--max-media-bytes``), and
the server keeps serving: corrupt, truncated, a decompression bomb, an unsupported
format, too many images, a file outside ``--allowed-local-media-path``, http(s)
URLs that are slow, huge, missing or on a host outside ``--allowed-media-domains``
(served by a local HTTP server), and the image placeholder written as text. The
front end never loads torch: images are processed in its helper process.
"""

from __future__ import annotations

import base64
import io
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.vl_models import make_llava, random_image

from .server_utils import RemoteServer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MAX_MEDIA_BYTES = 200_000
PART = "messages[0].content[1].image_url"


def png(image_seed: int = 0, size: tuple[int, int] = (48, 40)) -> bytes:
    buffer = io.BytesIO()
    random_image(image_seed, *size).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def decompression_bomb() -> bytes:
    """A valid PNG of 20000x20000 black pixels (1 bit each): 50 MB decoded, ~50 kB here."""
    width = height = 20_000

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    rows = zlib.compress(bytes(height * (1 + width // 8)), 9)
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")
    )


class MediaHandler(BaseHTTPRequestHandler):
    """/ok.png, /slow.png (answers after 4 s), /huge.png (over the byte limit), else 404."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/slow.png":
            time.sleep(4)
        bodies = {"/ok.png": png(3), "/slow.png": png(3), "/huge.png": bytes(MAX_MEDIA_BYTES + 10)}
        body = bodies.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def media_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), MediaHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("media")
    (directory / "cat.png").write_bytes(png(5))
    return directory


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, media_dir: Path) -> Iterator[RemoteServer]:
    model = tmp_path_factory.mktemp("llava")
    make_llava(model)
    args = [
        str(model),
        "--served-model-name", "llava",
        "--max-model-len", "512",
        "--num-blocks", "128",
        "--allowed-local-media-path", str(media_dir),
        "--allowed-media-domains", "127.0.0.1",
        "--media-fetch-timeout", "2",
        "--max-media-bytes", str(MAX_MEDIA_BYTES),
        "--limit-mm-per-prompt", '{"image": 2}',
    ]  # fmt: skip
    server = RemoteServer(args, tmp_path_factory.mktemp("log") / "server.log")
    yield server
    server.stop()


def _messages(*urls: str, text: str = "What is in the picture?") -> list[dict]:
    parts: list[dict] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": parts}]


def _post(server: RemoteServer, messages: list[dict]) -> httpx.Response:
    body = {"model": "llava", "messages": messages, "max_tokens": 3, "temperature": 0}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)


def test_the_openai_client_sends_a_base64_png_and_gets_an_answer(server: RemoteServer) -> None:
    with server.openai_client(timeout=120) as client:
        model = client.models.list().data[0].id
        assert model == "llava"
        result = client.chat.completions.create(
            model=model,
            messages=_messages(data_url(png())),  # type: ignore[arg-type]
            max_tokens=5,
            temperature=0,
        )
        assert result.choices[0].message.content
        assert result.usage is not None and result.usage.prompt_tokens > 16  # 16 image tokens
        chunks = list(
            client.chat.completions.create(
                model=model,
                messages=_messages(data_url(png())),  # type: ignore[arg-type]
                max_tokens=5,
                temperature=0,
                stream=True,
            )
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == result.choices[0].message.content


def test_images_by_file_and_http_url(
    server: RemoteServer, media_dir: Path, media_server: str
) -> None:
    response = _post(
        server, _messages((media_dir / "cat.png").as_uri(), f"http://{media_server}/ok.png")
    )
    assert response.status_code == 200, response.text


def test_the_front_end_never_loads_torch(server: RemoteServer) -> None:
    assert _post(server, _messages(data_url(png(9)))).status_code == 200
    front_end = psutil.Process(server.proc.pid)
    libraries = [m.path for m in front_end.memory_maps()]
    assert not [p for p in libraries if "libtorch" in p], "torch is loaded in the front end"


def _bad_requests(
    media_dir: Path, media_server: str, tmp_path: Path
) -> list[tuple[str, list, int, str]]:
    good = png()
    tiff = io.BytesIO()
    random_image(1).save(tiff, format="TIFF")
    outside = tmp_path / "secret.png"
    outside.write_bytes(good)
    return [
        ("corrupt", _messages(data_url(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20)), 400, PART),
        ("truncated", _messages(data_url(good[: len(good) // 2])), 400, PART),
        ("not base64", _messages("data:image/png;base64,@@@@"), 400, PART),
        ("decompression bomb", _messages(data_url(decompression_bomb())), 400, PART),
        ("unsupported format", _messages(data_url(tiff.getvalue(), "image/tiff")), 400, PART),
        ("too many images", _messages(*[data_url(good)] * 3), 400, "messages"),
        ("over the size limit", _messages(data_url(bytes(MAX_MEDIA_BYTES + 100))), 413, PART),
        ("file outside the allowed path", _messages(outside.as_uri()), 400, PART),
        ("slow URL", _messages(f"http://{media_server}/slow.png"), 400, PART),
        ("huge URL", _messages(f"http://{media_server}/huge.png"), 413, PART),
        ("missing URL", _messages(f"http://{media_server}/nope.png"), 400, PART),
        (
            "host not allowed",
            _messages(f"http://localhost:{media_server.rsplit(':', 1)[1]}/ok.png"),
            400,
            PART,
        ),
        ("unsupported URL scheme", _messages("ftp://example.com/cat.png"), 400, PART),
        (
            "a placeholder without its image",
            [{"role": "user", "content": "Look: <image>"}],
            400,
            "messages",
        ),
    ]


def test_every_bad_image_is_refused_naming_the_part(
    server: RemoteServer, media_dir: Path, media_server: str, tmp_path: Path
) -> None:
    for label, messages, status, param in _bad_requests(media_dir, media_server, tmp_path):
        response = _post(server, messages)
        assert response.status_code == status, f"{label}: {response.status_code} {response.text}"
        error = response.json()["error"]
        assert error["param"] == param, f"{label}: {error}"
        assert error["code"] == status
    # The engine kept serving throughout.
    assert _post(server, _messages(data_url(png(4)))).status_code == 200


def test_a_text_only_model_refuses_images_naming_the_part() -> None:
    """(The fake engine has no vision tower: the same refusal, without a model.)"""
    from tokenloom.default_model import default_model_path
    from tokenloom.engine.input_processor import InputProcessor
    from tokenloom.model.tokenizer import load_tokenizer

    processor = InputProcessor(load_tokenizer(default_model_path()), 256, 49152, [2])
    with pytest.raises(ValueError, match="^messages: this model takes no images"):
        processor.render_chat(_messages(data_url(png())))


def test_openai_client_sees_bad_request_errors(server: RemoteServer) -> None:
    with server.openai_client(timeout=120) as client, pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="llava",
            messages=_messages(data_url(b"not an image at all")),  # type: ignore[arg-type]
            max_tokens=2,
        )
    assert info.value.body["param"] == PART  # type: ignore[index]
