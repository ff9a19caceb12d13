"""Security suite: escapes from inside the box, resource exhaustion, faults, fuzzing, audit."""
