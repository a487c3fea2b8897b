-- migrate: no-transaction
-- 0027: the contact policy's decisions as one small index range, so docs/send_log.md Q11 ("who was held
-- back by the contact policy, and why?") reads the decisions since a day instead of every event ever
-- recorded: mail.send_event grows by two or more events per email forever (a sequential scan of all of
-- them per question, docs/performance.md "The send log at 20M rows"), while the decisions are ~1% of them.
-- Partial on the same expression Q11 filters on (starts_with(error, 'contact policy:')), so the planner
-- proves the predicate; key `at` (Q11's since and its order). Written only with a decision event (a
-- deferral or a skip), never on the hot path of a send.
-- Built CONCURRENTLY (no lock that blocks writes of mail.send_event); run outside a transaction; an
-- interrupted build leaves an invalid index that mailflow.migrate drops and builds again.
create index concurrently if not exists send_event_contact_policy_idx on mail.send_event (at, id)
    where starts_with(error, 'contact policy:');
