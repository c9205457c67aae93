"""How a message's content reaches a chat template, as vLLM's --chat-template-content-format has it.

OpenAI clients send a message's content as text or as a list of parts (`[{"type": "text", "text":
...}, ...]`). Templates read it one of two ways: "string", the content as one text (parts joined by
newlines, as vLLM joins them), or "openai", the list of parts, which templates written for
multimodal models loop over (Gemma 3's, Llama 4's, Mistral 3's: `{% for item in
message['content'] %}`); there text content goes as a list of one part. "auto", vLLM's default,
reads the template: one that loops over a message's content gets parts. The two renderings differ
for a message of several parts (Gemma 3 trims and concatenates its parts: "a" and "b" make "ab",
where the joined text makes "a\\nb"), so a prompt matches vLLM's only if the format does.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jinja2 import nodes

CONTENT_FORMATS = ("auto", "string", "openai")


def detect_content_format(template: nodes.Template) -> str:
    """"openai" for a parsed template that loops over a message's content (`message['content']`,
    `message.content`, or a variable set to either), else "string"."""
    aliases = {assign.target.name for assign in template.find_all(nodes.Assign)
               if isinstance(assign.target, nodes.Name) and _is_content(assign.node)}
    for loop in template.find_all(nodes.For):
        source = _unfiltered(loop.iter)
        if _is_content(source) or (isinstance(source, nodes.Name) and source.name in aliases):
            return "openai"
    return "string"


def shaped_content(message: Mapping[str, Any], content_format: str) -> Mapping[str, Any]:
    """`message` with its content as `content_format` ("string" or "openai") has it. ValueError for
    a part that is not a text part."""
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": [{"type": "text", "text": content}]} if content_format == "openai" else message
    if isinstance(content, list):
        if content_format == "openai":
            split_parts(content)  # each a text part or an image's place: what templates read
            return message
        if num_media_parts(message):
            raise ValueError("this chat template reads a message's content as text: it cannot place images or videos "
                             "(--chat-template-content-format openai, or a template that loops over the parts)")
        return {**message, "content": "\n".join(part_texts(content))}
    return message


IMAGE_PART = {"type": "image"}  # where an image goes, as templates of multimodal models read it
VIDEO_PART = {"type": "video"}  # and a video (Qwen-VL's templates)


def num_media_parts(message: Mapping[str, Any]) -> int:
    """Its images and videos."""
    content = message.get("content")
    return sum(part in (IMAGE_PART, VIDEO_PART) for part in content) if isinstance(content, list) else 0


def split_parts(parts: list[Any]) -> tuple[list[str], list[int], list[int]]:
    """Content parts as their texts and the indexes of their images and of their videos (common.proto's
    ChatMessage); ValueError for a part of another kind."""
    texts, images, videos = [], [], []
    for index, part in enumerate(parts):
        if part == IMAGE_PART:
            images.append(index)
        elif part == VIDEO_PART:
            videos.append(index)
        else:
            texts += part_texts([part])
    return texts, images, videos


def joined_parts(texts: list[str], image_indexes: list[int], video_indexes: list[int] = ()) -> list[dict[str, Any]]:
    """The converse of `split_parts`; ValueError for indexes that are not distinct places among the parts."""
    text_parts = iter(texts)
    images, videos = set(image_indexes), set(video_indexes)
    places = len(texts) + len(images) + len(videos)
    if len(images | videos) != len(image_indexes) + len(video_indexes) or any(i >= places for i in images | videos):
        raise ValueError("a message's image_parts and video_parts must be distinct indexes among its parts")
    return [dict(IMAGE_PART) if index in images else dict(VIDEO_PART) if index in videos else
            {"type": "text", "text": next(text_parts)} for index in range(len(texts) + len(images) + len(videos))]


def part_texts(parts: list[Any]) -> list[str]:
    texts = []
    for part in parts:
        if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"a content part must be {{\"type\": \"text\", \"text\": ...}}, got {part!r}")
        texts.append(part["text"])
    return texts


def content_chars(content: str | list[Any] | None) -> int:
    """The characters of a message's content, given as text or as text parts."""
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    return sum(len(part.get("text") or "") for part in content if isinstance(part, Mapping))


def _is_content(node: nodes.Node) -> bool:
    node = _unfiltered(node)
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    return isinstance(node, nodes.Getattr) and node.attr == "content"


def _unfiltered(node: nodes.Node) -> nodes.Node:
    # `message['content'] | selectattr('type', 'eq', 'text')` loops over the content all the same.
    while isinstance(node, nodes.Filter) and node.node is not None:
        node = node.node
    return node
