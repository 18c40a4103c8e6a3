-- Schema 14: a writer lane sends its COMMIT behind writes not yet answered. Each guarded write
-- of such a transaction asks this function whether it changed the rows its move expected; when
-- it did not (a lease taken over, a step moved meanwhile), the function fails the statement,
-- the transaction is aborted, and the COMMIT behind it rolls everything back.
CREATE FUNCTION agentrt_expect(changed int8[], expected int8[]) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF changed IS DISTINCT FROM expected THEN
        RAISE EXCEPTION 'agentrt: a guarded write changed % rows where its move expected %',
            changed, expected
            USING ERRCODE = 'AR001',
                  HINT = 'The group is rolled back and applied again move by move.';
    END IF;
    RETURN true;
END
$$;
