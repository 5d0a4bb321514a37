"""An OpenAI-compatible endpoint for tests/test_compose_stack.py: stands in for `serve-model`
(the `gpu` profile's `model` service) so the `qwen` llm agent plays for real without a GPU.

Every chat completion answers with the first action the prompt offers that it
recognises (Kuhn's check, call, bet, fold), and bills 100 prompt tokens and 1
completion token.
"""

from __future__ import annotations

import json
import re
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ACTIONS = re.compile(r"\b(check|call|bet|fold)\b")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def reply(self, code: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path.startswith("/health"):
            self.reply(200, {"status": "ok"})
        elif self.path.startswith("/v1/models"):
            self.reply(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})
        else:
            self.reply(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if not self.path.startswith("/v1/chat/completions"):
            self.reply(404, {"error": {"message": "not found"}})
            return
        text = " ".join(str(m.get("content", "")) for m in body.get("messages", []))
        found = ACTIONS.findall(text.lower())
        answer = found[-1] if found else "check"
        self.reply(
            200,
            {
                "id": f"chatcmpl-{time.time_ns()}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model", "fake"),
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": answer},
                    }
                ],
                "usage": {"prompt_tokens": 100, "completion_tokens": 1, "total_tokens": 101},
            },
        )

    def log_message(self, *args: object) -> None:
        pass


if __name__ == "__main__":
    ThreadingHTTPServer(("0.0.0.0", 8000), Handler).serve_forever()
