"""SpamAssassin archives and Nazario mailboxes from fixtures in their own formats."""

import io
import tarfile
from dataclasses import replace
from email.message import EmailMessage

from dohnuts.data.public import mail
from dohnuts.data.public.sources import locate, manifest

from .fixtures import local_path


def _message(subject, body, html=False) -> bytes:
    message = EmailMessage()
    message["From"], message["To"], message["Subject"] = "a@example.org", "b@example.org", subject
    if html:
        message.set_content("<html><style>p {color: red}</style><body><p>Verify your "
                            "<b>account</b> now</p><script>x()</script></body></html>", subtype="html")
    else:
        message.set_content(body)
    return message.as_bytes()


def _tar(path, members: dict):
    with tarfile.open(path, "w:bz2") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def test_spamassassin_and_nazario_messages_become_spam_and_phishing_questions(tmp_path):
    source = manifest()["mail"]
    files = {file.path: file for file in source.files}
    _tar(local_path(tmp_path, source, files["20030228_easy_ham.tar.bz2"]), {
        "easy_ham/00001.7c53336b37003a9286aba55d2945844c": _message("Lunch", "See you at noon, order 12345."),
        "easy_ham/00002.9c4069e25e1ef370c078db7ee85ff9ac": _message("Lunch", "See you at noon, order 67890."),
        "easy_ham/cmds": b"mv 00001 00002"})  # not a message
    _tar(local_path(tmp_path, source, files["20030228_spam.tar.bz2"]), {
        "spam/00001.bfc8d64d12b325ff385cca8d07b84288": _message("WIN", "", html=True),
        "spam/00002.00000000000000000000000000000000": _message("empty", " ")})  # no body: left out
    mbox = b"".join(b"From MAILER-DAEMON Mon Jan  1 00:00:00 2024\n" + _message(subject, body) + b"\n"
                    for subject, body in (("Your bank", "Confirm your password at http://evil.example"),
                                          ("Invoice", "Pay invoice 77 today")))
    local_path(tmp_path, source, files["phishing-2024"]).write_bytes(mbox)
    found, missing = locate(source, tmp_path)
    assert {file.path for file in missing} == set(files) - {"20030228_easy_ham.tar.bz2", "20030228_spam.tar.bz2",
                                                            "phishing-2024"}
    source = replace(source, files=tuple(file for file in source.files if file.path in found))
    rows = list(mail.mail(source, found))
    summary = [(row.record["group"], next(iter(row.record["labels"].values())), row.record["state"]["subject"])
               for row in rows]
    assert summary == [("mail_spam", False, "Lunch"), ("mail_phishing", False, "Lunch"),
                       ("mail_spam", False, "Lunch"), ("mail_phishing", False, "Lunch"),
                       ("mail_spam", True, "WIN"),
                       ("mail_phishing", True, "Your bank"), ("mail_phishing", True, "Invoice")]
    assert rows[0].record["state"]["body"] == "See you at noon, order 12345."
    assert rows[4].record["state"]["body"] == "Verify your account now"  # visible HTML text only
    assert rows[5].record["state"]["body"] == "Confirm your password at http://evil.example"
    assert rows[0].links == rows[2].links  # one campaign: only a number differs
    assert rows[0].links != rows[5].links and all(row.split is None for row in rows)
