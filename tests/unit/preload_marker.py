"""A module whose import leaves a mark: the file named by CHORUS_TEST_PRELOAD_MARK gets the importing process's pid."""

import os

_path = os.environ.get("CHORUS_TEST_PRELOAD_MARK")
if _path:
    with open(_path, "w") as f:
        f.write(str(os.getpid()))
