"""E-mail: the SpamAssassin public corpus (spam and ham) and Jose Nazario's phishing mailboxes.

`mail_spam` asks of every SpamAssassin message whether it is spam. `mail_phishing` asks whether
a message is phishing: Nazario's messages are, SpamAssassin's ham is not. A message's state is
its subject and its body as text (the plain part, else the HTML part's visible text); messages
with an empty body are left out. Messages that differ only in links and numbers (one campaign)
link, so a campaign sits in one partition.
"""

from __future__ import annotations

import email
import mailbox
import re
from collections.abc import Iterator
from email import policy
from html.parser import HTMLParser
from pathlib import Path

from ..guard import fingerprint
from .readers import tar_members
from .rows import Converted

_SPACE = re.compile(r"\s+")
_VARIABLE = re.compile(r"https?://\S+|\b\d+\b")
_MESSAGE = re.compile(r"(^|/)\d+\.[0-9a-f]+$")  # the corpus names each message <number>.<md5>
SPAM_QUESTION = {"spam": {"type": "noul", "instructions": "Is this e-mail unsolicited spam or bulk marketing?"}}
PHISHING_QUESTION = {"phishing": {"type": "noul", "instructions": "Is this e-mail a phishing or scam attempt to "
                                                                  "steal money, credentials or personal data?"}}


class _Visible(HTMLParser):
    """The visible text of an HTML document (script and style left out)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts, self._hidden = [], 0

    def handle_starttag(self, tag, attrs):
        self._hidden += tag in ("script", "style")

    def handle_endtag(self, tag):
        if tag in ("script", "style") and self._hidden:
            self._hidden -= 1

    def handle_data(self, data):
        if not self._hidden:
            self.parts.append(data)


def message_text(message) -> tuple[str, str]:
    """(subject, body text) of an e-mail message: its text/plain part, else the visible text of
    its text/html part; whitespace collapsed."""
    subject = _SPACE.sub(" ", str(message.get("subject", "") or "")).strip()
    part = None
    for kind in ("plain", "html"):
        try:
            part = message.get_body(preferencelist=(kind,))
        except (AttributeError, KeyError):
            part = None
        if part is not None:
            break
    if part is None:
        return subject, ""
    try:
        content = part.get_content()
    except (LookupError, KeyError, AssertionError):  # an unknown charset or a broken encoding
        payload = part.get_payload(decode=True) or b""
        content = payload.decode("utf-8", errors="replace")
    if not isinstance(content, str):
        content = content.decode("utf-8", errors="replace") if isinstance(content, bytes) else ""
    if part.get_content_subtype() == "html":
        parser = _Visible()
        parser.feed(content)
        content = " ".join(parser.parts)
    return subject, _SPACE.sub(" ", content).strip()


def _parsed(data: bytes):
    return email.message_from_bytes(data, policy=policy.default)


def _row(identifier: str, group: str, question: dict, label: bool, subject: str, body: str) -> Converted:
    qid = next(iter(question))
    record = {"id": identifier, "group": group, "state": {"subject": subject, "body": body},
              "questions": question, "labels": {qid: label}}
    return Converted(record, None, (f"mail-campaign:{fingerprint(_VARIABLE.sub('X', body))}",))


def mail(source, found) -> Iterator[Converted]:
    """Every message of the SpamAssassin archives (an archive with "spam" in its name holds
    spam) and of Nazario's mailboxes (phishing)."""
    for file in source.files:
        for path in found[file.path]:
            if file.path.endswith((".tar.bz2", ".tar.gz", ".tar")):
                yield from _spamassassin(file.path, path)
            else:
                yield from _nazario(file.path, path)


def _spamassassin(name: str, path: Path) -> Iterator[Converted]:
    spam = "spam" in name
    for member, data in tar_members(path, lambda member: bool(_MESSAGE.search(member))):
        subject, body = message_text(_parsed(data))
        if not body:
            continue
        identifier = f"{name}:{member}"
        yield _row(identifier, "mail_spam", SPAM_QUESTION, spam, subject, body)
        if not spam:
            yield _row(f"{identifier}:phishing", "mail_phishing", PHISHING_QUESTION, False, subject, body)


def _nazario(name: str, path: Path) -> Iterator[Converted]:
    box = mailbox.mbox(path, factory=lambda handle: _parsed(handle.read()), create=False)
    try:
        for index, message in enumerate(box):
            subject, body = message_text(message)
            if body:
                yield _row(f"{name}:{index}", "mail_phishing", PHISHING_QUESTION, True, subject, body)
    finally:
        box.close()


CONVERTERS = {"mail": mail}
