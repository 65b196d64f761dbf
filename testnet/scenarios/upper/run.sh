# Upper-cases its input: any honest worker delivers the same bytes.
tr a-z A-Z < "$CANNABIS_INPUTS/in.txt" > "$CANNABIS_WORK/out.txt"
