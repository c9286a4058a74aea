"""Prompt -> token ids for CAR (§11): the ``tokenizers`` package plus the model's chat template,
rendered with jinja2 the way Hugging Face ``apply_chat_template`` renders it.

``--tokenizer_path`` is either a directory holding ``tokenizer.json`` and (optionally)
``tokenizer_config.json`` (its ``chat_template``, a string or a list of named templates of
which ``default`` is used, and its special tokens) or ``chat_template.jinja`` (preferred when
both exist, as HF does), or a single ``tokenizer.json`` file (no chat template).

Rendering follows HF: an immutable sandboxed jinja2 environment with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, ``{% generation %}`` blocks rendered as
their body, ``tojson`` (``ensure_ascii=False``), ``raise_exception`` and ``strftime_now``;
variables ``messages``, ``tools``, ``add_generation_prompt`` and the special tokens
(``bos_token``, ``eos_token``, ...), plus the request's ``chat_template_kwargs``. The rendered
chat is encoded without added special tokens (the template carries them); a completion prompt
is encoded with them, like ``tokenizer(prompt)``.

Repeated text (a conversation's earlier turns) is not tokenized again: the segment token cache
(:mod:`kvsvc.routing.token_cache`, ``--tokenizer_cache_tokens``) reuses the ids of segments
already seen, cut only where the result is the whole text's.

Text the service cannot tokenize exactly (no tokenizer, no chat template, a template error)
gives ``None``: the request routes with hit ratio 0 (never a guessed hit), warned once per kind.

Errors: :class:`~kvsvc.errors.ConfigError` (``--tokenizer_path``) when loading fails;
:class:`~kvsvc.errors.TemplateError` from :meth:`PromptTokenizer.render_chat` and
:meth:`PromptTokenizer.encode_chat` (:class:`TokenSource` turns it into ``None`` tokens).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvsvc.errors import ConfigError, TemplateError
from kvsvc.routing.token_cache import SegmentTokenCache

log = logging.getLogger(__name__)

FIELD = "--tokenizer_path"
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                       "cls_token", "mask_token")


class _GenerationTag(jinja2.ext.Extension):
    """HF's ``{% generation %}...{% endgeneration %}`` (marks assistant text for masks):
    rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # HF's filter: jinja's own tojson HTML-escapes, which would change the tokens.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(value: Any) -> Optional[str]:
    """A special token from ``tokenizer_config.json``: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _pick_template(value: Any, source: str) -> Optional[str]:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        template = named.get("default")
        if isinstance(template, str):
            return template
        raise ConfigError(FIELD, f"{source}: chat_template list has no 'default' template")
    raise ConfigError(FIELD, f"{source}: chat_template must be a string or a list")


class PromptTokenizer:
    """A loaded tokenizer and optional chat template. Thread-safe: encoding only reads the
    Rust tokenizer (never changes truncation/padding) and a compiled template.

    :param tokenizer: a ``tokenizers.Tokenizer``.
    :param chat_template: jinja2 source, ``None`` when the model has none.
    :param special_tokens: template variables such as ``bos_token`` -> text.
    :param cache_tokens: bound of the segment token cache, token ids
        (:class:`~kvsvc.routing.token_cache.SegmentTokenCache`); 0: no cache, every text is
        tokenized whole.
    :raises ConfigError: the template does not compile.
    """

    def __init__(self, tokenizer: Any, chat_template: Optional[str] = None,
                 special_tokens: Optional[Mapping[str, str]] = None,
                 cache_tokens: int = 0) -> None:
        self._tokenizer = tokenizer
        self.cache: Optional[SegmentTokenCache] = (
            SegmentTokenCache(tokenizer, cache_tokens) if cache_tokens > 0 else None)
        self._special = dict(special_tokens or {})
        self._template: Optional[jinja2.Template] = None
        if chat_template is not None:
            try:
                self._template = _environment().from_string(chat_template)
            except jinja2.TemplateError as exc:
                raise ConfigError(FIELD, f"chat template does not compile: {exc}") from exc

    @classmethod
    def load(cls, path: str, cache_tokens: int = 0) -> "PromptTokenizer":
        """Load from ``--tokenizer_path`` (see the module docstring).

        :param path: a directory with ``tokenizer.json``, or a ``tokenizer.json`` file.
        :param cache_tokens: the segment token cache's bound (0: none), see the class.
        :raises ConfigError: missing or unreadable files, invalid JSON, a bad template.
        """
        from tokenizers import Tokenizer  # heavy import, only when configured

        root = Path(path)
        tok_file = root / "tokenizer.json" if root.is_dir() else root
        if not tok_file.is_file():
            raise ConfigError(FIELD, f"{tok_file} not found")
        try:
            tokenizer = Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust binding raises plain Exception
            raise ConfigError(FIELD, f"{tok_file}: cannot load tokenizer: {exc}") from exc
        template: Optional[str] = None
        special: dict[str, str] = {}
        if root.is_dir():
            cfg_file = root / "tokenizer_config.json"
            if cfg_file.is_file():
                try:
                    cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
                except (OSError, ValueError) as exc:
                    raise ConfigError(FIELD, f"{cfg_file}: cannot read JSON: {exc}") from exc
                if not isinstance(cfg, dict):
                    raise ConfigError(FIELD, f"{cfg_file}: not a JSON object")
                template = _pick_template(cfg.get("chat_template"), str(cfg_file))
                for key in _SPECIAL_TOKEN_KEYS:
                    text = _token_text(cfg.get(key))
                    if text is not None:
                        special[key] = text
            jinja_file = root / "chat_template.jinja"
            if jinja_file.is_file():
                try:
                    template = jinja_file.read_text(encoding="utf-8")
                except OSError as exc:
                    raise ConfigError(FIELD, f"{jinja_file}: {exc.strerror}") from exc
        log.info("tokenizer loaded from %s (chat template %s)", tok_file,
                 "yes" if template is not None else "none")
        return cls(tokenizer, template, special, cache_tokens)

    @property
    def has_chat_template(self) -> bool:
        """True when chat messages can be rendered."""
        return self._template is not None

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.cache is not None:
            return self.cache.encode(text, add_special_tokens)
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_text(self, text: str) -> list[int]:
        """Token ids of a completion prompt, special tokens added (``tokenizer(text)``)."""
        return self._encode(text, True)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    add_generation_prompt: bool = True, tools: Optional[list] = None,
                    extra: Optional[Mapping[str, Any]] = None) -> str:
        """The chat as the engine's template renders it.

        :param messages: OpenAI chat messages (``role``, ``content`` ...), passed as given.
        :param add_generation_prompt: append the assistant turn's opening.
        :param tools: the request's ``tools``, or ``None``.
        :param extra: the request's ``chat_template_kwargs`` (cannot override ``messages``).
        :raises TemplateError: no template, or the template raised or failed.
        """
        if self._template is None:
            raise TemplateError("no chat template")
        variables: dict[str, Any] = dict(self._special)
        variables.update(extra or {})
        variables.update(messages=list(messages), tools=tools,
                         add_generation_prompt=add_generation_prompt)
        try:
            return self._template.render(**variables)
        except TemplateError:
            raise
        except Exception as exc:  # jinja2 errors and whatever a template's filters raise
            raise TemplateError(str(exc)) from exc

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    add_generation_prompt: bool = True, tools: Optional[list] = None,
                    extra: Optional[Mapping[str, Any]] = None) -> list[int]:
        """Token ids of a rendered chat (no special tokens added: the template has them).

        :raises TemplateError: see :meth:`render_chat`.
        """
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt,
                                tools=tools, extra=extra)
        return self._encode(text, False)


@dataclass(frozen=True, slots=True)
class CompletionPrompt:
    """A validated ``/v1/completions`` prompt: exactly one of ``text`` and ``token_ids``.

    A batch of several prompts has neither (routed with hit ratio 0).
    """

    text: Optional[str] = None
    token_ids: Optional[list[int]] = None


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A validated ``/v1/chat/completions`` request's template inputs.

    :ivar messages: the request's messages (each a JSON object with a string ``role``).
    :ivar add_generation_prompt: vLLM-style request field, default True.
    :ivar tools: the request's ``tools`` list or ``None``.
    :ivar template_kwargs: the request's ``chat_template_kwargs`` or ``{}``.
    """

    messages: list[dict]
    add_generation_prompt: bool = True
    tools: Optional[list] = None
    template_kwargs: Optional[dict] = None


class TokenSource:
    """Turns request prompts into token ids for the policy, warning once per kind of failure.

    :param tokenizer: the loaded tokenizer, ``None`` without ``--tokenizer_path``.
    """

    def __init__(self, tokenizer: Optional[PromptTokenizer]) -> None:
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    def _warn_once(self, kind: str, message: str, *args: Any) -> None:
        with self._lock:
            if kind in self._warned:
                return
            self._warned.add(kind)
        log.warning(message, *args)

    def completion_tokens(self, prompt: CompletionPrompt) -> Optional[list[int]]:
        """Token ids of a completion prompt, ``None`` when they cannot be known exactly."""
        if prompt.token_ids is not None:
            return prompt.token_ids
        if prompt.text is None:
            return None
        if self.tokenizer is None:
            self._warn_once("no-tokenizer", "no --tokenizer_path: text prompts route with hit "
                            "ratio 0 (warned once)")
            return None
        return self.tokenizer.encode_text(prompt.text)

    def chat_tokens(self, prompt: ChatPrompt) -> Optional[list[int]]:
        """Token ids of a chat request, ``None`` when they cannot be known exactly."""
        if self.tokenizer is None:
            self._warn_once("no-tokenizer", "no --tokenizer_path: text prompts route with hit "
                            "ratio 0 (warned once)")
            return None
        if not self.tokenizer.has_chat_template:
            self._warn_once("no-template", "the tokenizer has no chat template: chat requests "
                            "route with hit ratio 0 (warned once)")
            return None
        try:
            return self.tokenizer.encode_chat(
                prompt.messages, add_generation_prompt=prompt.add_generation_prompt,
                tools=prompt.tools, extra=prompt.template_kwargs)
        except TemplateError as exc:
            self._warn_once("template-error", "chat template failed (%s): such requests route "
                            "with hit ratio 0 (warned once)", exc)
            return None
