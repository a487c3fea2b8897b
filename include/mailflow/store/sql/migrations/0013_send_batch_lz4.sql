-- 0013: the batch bytes (mail.send_batch.body, ~100-150 kB per chunk of 100 emails) are
-- TOAST-compressed with lz4 instead of pglz where the server supports it: the mint stores one body
-- per chunk inside its transaction, and pglz cost 2-5 ms of it (measured at 100-300 kB on
-- PostgreSQL 15 here: 8.6 ms vs 3.9 ms per 300 kB insert, and lz4's output was 40 percent smaller).
-- Only new values are compressed the new way; stored bodies stay readable as they are. A catalog
-- change, no table rewrite. On a server built without lz4 (e.g. the embedded default), nothing
-- changes (a notice says so).
do $$
begin
    alter table mail.send_batch alter column body set compression lz4;
exception when feature_not_supported then
    raise notice 'this server has no lz4 support: mail.send_batch.body stays pglz-compressed';
end
$$;
