"""Pure text checks shared by the serving stages and the replay job's quality report: which
language a text is in (`language`), and the spans a translation must keep as they are (`spans`:
numbers, URLs, ids, placeholders; masking and restoring them). Below both: they import nothing
of tolk but each other, so replay reads translations with the stages' own rules without
importing a stage.
"""
