"""JSON of the store's own files (index, ``LATEST``, payload headers, host state), parsed safely.

Every way such a file can be malformed (not UTF-8, not JSON, nested deeper than the parser's
recursion limit, strings holding lone surrogates that no file or log could encode) is a
``FormatError`` naming the file, never a ``RecursionError`` or a ``UnicodeEncodeError`` later.
"""

from __future__ import annotations

import json
from typing import Any

from miles_disagg.types import FormatError


def load_json(data: bytes | str, where: object) -> Any:
    """``json.loads(data)``; ``FormatError`` naming ``where`` for anything malformed."""
    try:
        obj = json.loads(data)
        json.dumps(obj, ensure_ascii=False).encode("utf-8")  # lone surrogates cannot be written back
    except RecursionError:
        raise FormatError(f"{where}: JSON nested too deeply") from None
    except UnicodeError as exc:
        raise FormatError(f"{where}: not valid UTF-8 text ({exc.reason})") from None
    except ValueError as exc:
        raise FormatError(f"{where}: not valid JSON ({exc})") from None
    return obj
