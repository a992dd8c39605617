import pytest

from pivotrl.errors import UserError
from pivotrl.recipes.prepare import ensure_data


@pytest.mark.parametrize("under", ["", "sub"])
def test_a_data_directory_that_is_a_file_is_a_user_error(under, tmp_path):
    file = tmp_path / "data"
    file.write_text("kept\n")
    data = file / under if under else file
    with pytest.raises(UserError, match=f"data directory {data}: not a directory"):
        ensure_data(data)
    assert file.read_text() == "kept\n"
