"""What a rank is told when its launcher left out a variable multigpu needs: the launcher found and its variables."""

import pytest

from multigpu.runtime import environments as envs


@pytest.mark.parametrize(
    ("environ", "said"),
    [
        ({"MULTIGPU_RANK": "1"}, ["looks started by multigpu's supervisor, but MULTIGPU_WORLD_SIZE is not set",
                                  "MULTIGPU_RANK and MULTIGPU_WORLD_SIZE", "exported in your shell", "unset it"]),
        ({"OMPI_COMM_WORLD_RANK": "1"}, ["looks started by mpirun (Open MPI or PMI), but OMPI_COMM_WORLD_SIZE is "
                                         "not set", "OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE", "PMI_RANK"]),
    ],
)
def test_a_variable_the_launcher_left_out_is_named_with_the_launcher_and_what_it_sets(environ, said):
    with pytest.raises(ValueError) as raised:
        envs.detect(environ)
    for text in said:
        assert text in str(raised.value), str(raised.value)
    assert "Start the script through the launcher itself" in str(raised.value)
