"""Checks for the workbook's exercises: each says precisely what is wrong with a reader's attempt."""
