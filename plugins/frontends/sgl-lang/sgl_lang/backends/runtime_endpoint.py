"""``RuntimeEndpoint(url)``: sgl's server, or SGLang's (same wire format), over HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx

from sgl_lang.backends.base import NativeBackend
from sgl_lang.errors import BackendError

__all__ = ["RuntimeEndpoint"]


class RuntimeEndpoint(NativeBackend):
    """A server with SGLang's native API at ``base_url``.

    :param api_key: sent as ``Authorization: Bearer <key>``.
    :param chat_template: a name from :data:`sgl_lang.chat_template.TEMPLATES`; default: the
        one matching the served model's own template (rendered through ``/v1/tokenize`` and
        ``/v1/detokenize`` when the server has them), else its name.
    :param timeout: seconds to wait for one request.
    :raises BackendError: when the server cannot be reached or refuses ``/get_model_info``.
    """

    def __init__(self, base_url: str, api_key: str | None = None,
                 chat_template: str | None = None, timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        self.model_info = self._request("GET", "/get_model_info")
        name = str(self.model_info.get("model_path") or "")
        self._pick_template(chat_template, None if chat_template else self._render_probe(),
                            name)

    def _render_probe(self) -> str | None:
        """A user turn rendered with the server's chat template, if the server can say."""
        try:
            ids = self._request("POST", "/v1/tokenize", json={
                "messages": [{"role": "user", "content": "hi"}]})["tokens"]
            return self._request("POST", "/v1/detokenize", json={"tokens": ids})["prompt"]
        except (BackendError, KeyError, TypeError):
            return None

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self.client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise BackendError(f"cannot reach the server at {self.base_url}: {exc}") from None
        if response.status_code != 200:
            raise BackendError(_error_message(response, path), response.status_code)
        return response.json()

    def _generate(self, body: dict[str, Any]) -> Any:
        return self._request("POST", "/generate", json=body)

    def _generate_stream(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        try:
            with self.client.stream("POST", "/generate", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise BackendError(_error_message(response, "/generate"),
                                       response.status_code)
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        raise BackendError(f"/generate failed: {event['error'].get('message')}",
                                           event["error"].get("code"))
                    yield event
        except httpx.HTTPError as exc:
            raise BackendError(f"cannot reach the server at {self.base_url}: {exc}") from None

    def flush_cache(self) -> None:
        self._request("POST", "/flush_cache")

    def get_server_info(self) -> dict[str, Any]:
        return self._request("GET", "/get_server_info")

    def shutdown(self) -> None:
        self.client.close()

    def __repr__(self) -> str:
        return f"RuntimeEndpoint({self.base_url!r})"


def _error_message(response: httpx.Response, path: str) -> str:
    try:
        body = response.json()
        message = body["error"]["message"] if isinstance(body.get("error"), dict) \
            else body.get("error") or body.get("detail") or body
    except (ValueError, AttributeError, KeyError, TypeError):
        message = response.text
    return f"{path} answered {response.status_code}: {message}"
