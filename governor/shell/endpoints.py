"""An endpoint as a flag or a file's [[endpoint]] table names it: `ADDRESS[,key=value...]`, a
worker's address (host:port, unix:PATH) or an OpenAI-compatible server's URL, with its soft caps
(concurrency, tokens, qps, burst, weight), its forecast (step_ms, batch) and, for a server, what
to ask it for (model, api_key_file, served_as, ignore_eos) and whether to probe it (probe)."""

from __future__ import annotations

from urllib.parse import urlsplit

from governor.admission.endpoint import EndpointLimits, OpenAITarget
from govwire.address import Address, parse_address

_LIMIT_KEYS = {
    "concurrency": int,
    "tokens": int,
    "qps": float,
    "burst": float,
    "weight": float,
    "step_ms": float,
    "batch": int,
}
TARGET_KEYS = (
    "model",
    "api_key_file",
    "served_as",
    "ignore_eos",
    "probe",
)  # of an OpenAI-compatible endpoint (http(s)://)


def parse_endpoint(text: str) -> tuple[Address | OpenAITarget, EndpointLimits]:
    """`ADDRESS[,concurrency=N][,tokens=T][,qps=R][,burst=B][,weight=W][,step_ms=S][,batch=N]` -> the address and its
    soft caps (and, for the release forecast, `step_ms`, its prior of the time per token, and `batch`, how many requests
    the server runs at once, the rest queued in it). An ADDRESS that is an `http://` or `https://`
    URL (up to `/v1`) is an OpenAI-compatible server, and takes `model=NAME` (required), `api_key_file=PATH`,
    `served_as=NAME` (its name at the front door), `ignore_eos=pass|refuse` and `probe=on|off` too."""
    address, *options = text.split(",")
    is_http = address.startswith(("http://", "https://"))
    values, target = _endpoint_options(options, is_http)
    limits = EndpointLimits(**values)  # type: ignore[arg-type]
    if not is_http:
        return parse_address(address), limits
    return _openai_target(address, target), limits


def _endpoint_options(options: list[str], is_http: bool) -> tuple[dict[str, int | float], dict[str, str]]:
    """An endpoint's `key=value` options, split into its numeric limits and (for an http(s) URL)
    the keys that describe its target; one error per bad option, in the order written, so a typo
    is named before any check of what the options mean."""
    values: dict[str, int | float] = {}
    target: dict[str, str] = {}
    for item in options:
        key, sep, value = (part.strip() for part in item.partition("="))
        if is_http and sep and key in TARGET_KEYS:
            target[key] = value
            continue
        kind = _LIMIT_KEYS.get(key)
        if not sep or kind is None:
            keys = [*_LIMIT_KEYS, *(TARGET_KEYS if is_http else ())]
            raise ValueError(f"expected key=value with a key among {', '.join(keys)}, got {item!r}")
        try:
            values[key] = kind(value)
        except ValueError:
            raise ValueError(f"{key}={value!r} is not a number") from None
    return values, target


def _openai_target(address: str, target: dict[str, str]) -> OpenAITarget:
    """An OpenAI-compatible endpoint from its URL and target keys: the URL must name a host (and
    a numeric port, if any), `model` is required (the name its requests carry upstream), and
    `served_as`, when given, must name one (front-door clients send it)."""
    try:
        url = urlsplit(address)
        url.port  # noqa: B018 (a port that is not a number raises here)
    except ValueError as exc:
        raise ValueError(f"{address!r} is not an http(s) URL: {exc}") from None
    if not url.hostname:
        raise ValueError(f"{address!r} is not an http(s) URL with a host")
    if not target.get("model"):
        raise ValueError("an OpenAI-compatible endpoint needs model=NAME (the model its requests name)")
    ignore_eos = target.get("ignore_eos", "pass")
    if ignore_eos not in ("pass", "refuse"):
        raise ValueError(f"ignore_eos={ignore_eos!r}: expected pass (send it on) or refuse (answer 400)")
    probe = target.get("probe", "on")
    if probe not in ("on", "off"):
        raise ValueError(f"probe={probe!r}: expected on (measure it as it comes up) or off")
    served_as = target.get("served_as", "")
    if "served_as" in target and not served_as:
        raise ValueError("served_as must name the model (it is what front-door clients send)")
    return OpenAITarget(
        address.rstrip("/"),
        target["model"],
        target.get("api_key_file", ""),
        served_as,
        ignore_eos,  # type: ignore[arg-type]
        probe == "on",
    )
