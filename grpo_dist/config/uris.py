"""URIs in a config and in what a run prints: joined, shown with every credential masked, and the credentials a URI
carries found (a config that holds one is refused: `grpo_dist.config.refuse_credentials`)."""

from __future__ import annotations

import re
from urllib.parse import unquote


def uri_join(uri: str, *parts: str) -> str:
    """`uri` with `parts` appended to its path, its query kept (`s3://b/r?endpoint_override=h:9`, ...)."""
    base, sep, query = uri.partition("?")
    return "/".join([base.rstrip("/"), *filter(None, parts)]) + sep + query


URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"]*")
"""A URI (`s3://...`, `https://...`) on its own or inside a message, up to the next blank or quote."""
SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
"""How a URI begins: a value that begins so is read as a URI, whole, even past a blank or a quote."""
CREDENTIAL_PARAMETER = re.compile(r"key|secret|token|password|passwd|credential|signature|^sig$", re.IGNORECASE)
"""A query parameter whose value is a credential: pyarrow's `access_key`, `secret_key`, `session_token`,
`access_token`, `account_key`, `sas_token`, `client_secret`; a presigned URL's `X-Amz-Credential`, `X-Amz-Signature`,
`X-Amz-Security-Token`, Azure's `sig`."""
CREDENTIALS_GO = (
    "credentials come from each node's environment or the provider's own files, never from a URI (it would be "
    "printed and written to config.yaml, every checkpoint and the W&B config): AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), or ~/.aws/credentials with AWS_PROFILE, for s3://; "
    "GOOGLE_APPLICATION_CREDENTIALS for gs://; HADOOP_USER_NAME and a Kerberos ticket for hdfs://; the endpoint may "
    "stay in the URI (`?endpoint_override=host:9000&scheme=http`) or go to AWS_ENDPOINT_URL"
)


def _redact_one(uri: str) -> str:
    scheme, _, rest = uri.partition("://")
    if "@" in rest:  # userinfo; a password may hold `/` or `?`, so everything up to the last `@` goes
        rest = "***" + rest[rest.rindex("@") :]
    base, sep, query = rest.partition("?")
    parameters = []
    for parameter in query.split("&") if sep else []:
        name, equals, value = parameter.partition("=")
        parameters.append(f"{name}=***" if CREDENTIAL_PARAMETER.search(unquote(name)) else parameter)
    return f"{scheme}://{base}{sep}{'&'.join(parameters)}"


def redact(text: str) -> str:
    """`text` (a URI, or a message holding URIs) with whatever in a URI could be a credential masked: a user and
    password before `@` (`s3://***@bucket/path`) and each credential query parameter's value (`?secret_key=***`).
    For every line that shows a URI."""
    return URI.sub(lambda match: _redact_one(match.group()), text)


def uri_credentials(value: str) -> list[str]:
    """What in `value`, when it is a URI (it begins with `scheme://`), is a credential: a user or password before
    `@`, and each credential query parameter by name. Read over the whole value, so a credential holding a character
    no URI carries (a quote in a password) is found too. Empty for a URI without any, and for anything that is not a
    URI."""
    if not SCHEME.match(value):
        return []
    rest = value.partition("://")[2]
    found = ["a user or password before '@'"] if "@" in rest else []
    query = rest.rpartition("@")[2].partition("?")[2]
    names = [unquote(parameter.partition("=")[0]) for parameter in query.split("&") if parameter]
    return found + [f"query parameter {name!r}" for name in names if CREDENTIAL_PARAMETER.search(name)]


def shown_uri(value: str) -> str:
    """`value`, a URI, as a message may show it: redacted; one holding a blank or a quote, where a redaction cannot
    tell where a credential ends, as its scheme alone."""
    if URI.fullmatch(value):
        return redact(value)
    scheme = value.partition("://")[0]
    return f"the {scheme}:// URI (not shown: it holds a blank or a quote, which a URI carries only percent-encoded)"
